"""Log-probabilities: the log-softmax of the model's logits, before penalties and temperature, for the rows that ask."""

from __future__ import annotations

import pytest
import torch
import transformers

from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.sampling_params import InvalidParameterError, SamplingParams
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.engine.runner.model_runner import ModelRunner
from minibatch.engine.weights.loader import load_model

from .fakes import CharTokenizer


def test_logprobs_equal_hf_log_softmax_before_penalties_and_only_for_rows_that_ask(tiny_llama_dir):
    model = load_model(tiny_llama_dir, TorchAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    runner = ModelRunner(model, allocate_kv_cache(model.config, 40, 4), 4)
    engine = LLMEngine(runner, CharTokenizer(), BlockManager(40, 4), SchedulerConfig(4, 64, 256))
    asks = engine.add_request(
        "asks",
        [5, 6, 7, 8],
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=3, max_tokens=6, ignore_eos=True, logprobs=4),
    )
    quiet = engine.add_request("quiet", [9, 10, 11], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = []
    while engine.has_work():
        outs += engine.step()[0]
    assert len(asks.output_logprobs) == 6 and quiet.output_logprobs == []
    assert all(o.logprobs is None for o in outs if o.request_id == "quiet")
    streamed = [e for o in outs if o.request_id == "asks" for e in o.logprobs]
    assert streamed == asks.output_logprobs  # the deltas carry exactly one entry per token
    ids = asks.prompt_token_ids + asks.output_token_ids
    for i, (lp, top) in enumerate(asks.output_logprobs):
        n = len(asks.prompt_token_ids) + i
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids[:n]])).logits[0, -1].float(), -1)
        assert lp == pytest.approx(float(ref[ids[n]]), abs=1e-4)
        assert [t for t, _ in top] == ref.topk(4).indices.tolist()
        assert [v for _, v in top] == pytest.approx(ref.topk(4).values.tolist(), abs=1e-4)


def test_logprobs_bounds():
    SamplingParams(logprobs=0)
    SamplingParams(logprobs=20)
    for bad in (-1, 21, 2.5):
        with pytest.raises(InvalidParameterError, match="logprobs"):
            SamplingParams(logprobs=bad)
