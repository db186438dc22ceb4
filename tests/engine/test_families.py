"""Qwen3 (q/k RMSNorm per head), Mistral (sliding-window attention) and Phi-3 (fused projections, LongRoPE, a
window) against Hugging Face, logits within 1e-4.

The window (8 positions) is smaller than the test sequences, so it matters:
through a packed prefill, a chunked prefill over cached context, shuffled
block tables, decode steps with and without the C++ decode kernel, and greedy
generation in a mixed batch through the engine.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.engine.weights.loader import load_model

from ..conftest import TINY_COMMON

BLOCK_SIZE = 4
WINDOW = 8


def _save(kind: str, path):
    torch.manual_seed(3)
    common = {**TINY_COMMON, "vocab_size": 300}
    if kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "phi3":  # fused qkv and gate_up, LongRoPE (short factors below the original length), a window
        half = TINY_COMMON["hidden_size"] // TINY_COMMON["num_attention_heads"] // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.15 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
        }
        cfg = transformers.Phi3Config(
            **{**common, "max_position_embeddings": 256},
            original_max_position_embeddings=64,
            rope_parameters=rope,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = transformers.Phi3ForCausalLM(cfg)
    elif kind in (
        "gemma2",
        "gemma3",
        "gemma3-vision",
    ):  # windows alternate by layer; gemma2 soft-caps, gemma3 has two rope bases
        extra = dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            tie_word_embeddings=True,
            num_hidden_layers=4,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
        )
        if kind == "gemma2":
            cfg = transformers.Gemma2Config(**common | extra, attn_logit_softcapping=20.0, final_logit_softcapping=5.0)
            model = transformers.Gemma2ForCausalLM(cfg)
        else:
            cfg = transformers.Gemma3TextConfig(
                **common | extra, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4
            )
            model = transformers.Gemma3ForCausalLM(cfg)
            if kind == "gemma3-vision":  # the same text model in a vision model's folder (its tower beside it)
                vision = dict(
                    model_type="siglip_vision_model",
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=32,
                    patch_size=8,
                    vision_use_head=False,
                )
                cfg = transformers.Gemma3Config(
                    text_config=cfg,
                    vision_config=vision,
                    mm_tokens_per_image=4,
                    image_token_index=299,
                    boi_token_index=297,
                    eoi_token_index=298,
                )
                model = transformers.Gemma3ForConditionalGeneration(cfg)
        with torch.no_grad():  # init leaves the norms at zero (a scale of 1 + 0); make them matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    else:
        cfg = transformers.Qwen3Config(
            **common, head_dim=16, tie_word_embeddings=True, attention_bias=False, rope_theta=1e6
        )
        model = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # init leaves the q/k norms at ones; make them matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["mistral", "qwen3", "phi3", "gemma2", "gemma3", "gemma3-vision"])
def family(request, tmp_path_factory):
    path = _save(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def backends():
    from minibatch.kernels.cpu.paged_attention import load_extension, store_and_attention

    out = [("torch", TorchAttentionBackend())]
    if load_extension() is not None:
        out.append(("cpu-kernel", TorchAttentionBackend(store_and_attention)))
    return out


def test_config_reads_the_family_features(family):
    kind, path, _ = family
    ours = load_model(path, TorchAttentionBackend())
    assert ours.config.model_type == {"gemma3": "gemma3_text", "gemma3-vision": "gemma3_text"}.get(kind, kind)
    assert ours.config.image_token_id == (299 if kind == "gemma3-vision" else None)
    assert ours.config.sliding_window == (WINDOW if kind in ("mistral", "phi3") else None)
    assert ours.config.qk_norm == (kind in ("qwen3", "gemma3", "gemma3-vision"))
    if kind.startswith("gemma"):  # sliding layers alternate with global ones
        assert ours.config.layer_windows == (WINDOW, 0, WINDOW, 0)
        assert (ours.config.attn_softcap, ours.config.final_softcap) == (
            (20.0, 5.0) if kind == "gemma2" else (None, None)
        )
        assert (ours.config.rope_local is not None) == kind.startswith("gemma3")
    if kind == "phi3":  # LongRoPE: the model's context is the long one; a server runs the original by default
        assert ours.config.rope.rope_type == "longrope" and ours.config.max_position == 256
        assert ours.config.default_context == 64 and ours.model.rotary.cos.shape[0] == 64
        assert ours.config.rope.attention_factor == pytest.approx((1 + math.log(256 / 64) / math.log(64)) ** 0.5)


@pytest.mark.parametrize("backend_name", ["torch", "cpu-kernel"])
def test_packed_prefill_and_decode_match_hf(family, backend_name):
    kind, path, hf = family
    backend = dict(backends()).get(backend_name)
    if backend is None:
        pytest.skip("the C++ extension cannot be built here")
    ours = load_model(path, backend)
    rng = random.Random(11)
    seqs = [[rng.randrange(3, 300) for _ in range(n)] for n in (13, 20, 5)]
    per_seq = -(-(20 + 8) // BLOCK_SIZE)
    pool = list(range(1, 3 * per_seq + 4))
    rng.shuffle(pool)
    tables = [pool[i * per_seq : (i + 1) * per_seq] for i in range(3)]
    caches = allocate_kv_cache(ours.config, len(pool) + 1, BLOCK_SIZE)
    batch = build_flat_batch(seqs, [0, 0, 0], tables, BLOCK_SIZE)
    with torch.no_grad():
        logits = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn))
    start = 0
    for ids in seqs:
        torch.testing.assert_close(logits[start : start + len(ids)], hf_logits(hf, ids), atol=1e-4, rtol=0)
        start += len(ids)
    for _ in range(8):  # decode past the window for every sequence
        nxt = [int(hf_logits(hf, s)[-1].argmax()) for s in seqs]
        batch = build_flat_batch([[t] for t in nxt], [len(s) for s in seqs], tables, BLOCK_SIZE)
        with torch.no_grad():
            step = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn))
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            torch.testing.assert_close(step[i], hf_logits(hf, seqs[i])[-1], atol=1e-4, rtol=0)


def test_chunked_prefill_over_cached_context_matches_hf(family):
    kind, path, hf = family
    ours = load_model(path, TorchAttentionBackend())
    ids = list(range(3, 40))
    table = [6, 2, 9, 1, 4, 7, 10, 8, 3, 5]
    caches = allocate_kv_cache(ours.config, 11, BLOCK_SIZE)
    outs = []
    for start, end in ((0, 13), (13, 17), (17, 37)):
        b = build_flat_batch([ids[start:end]], [start], [table], BLOCK_SIZE)
        with torch.no_grad():
            outs.append(ours.compute_logits(ours(b.input_ids, b.positions, caches, b.attn)))
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_greedy_generation_in_a_mixed_batch_equals_hf_generate(family):
    from minibatch.engine.core.block_manager import BlockManager
    from minibatch.engine.core.config import SchedulerConfig
    from minibatch.engine.core.engine import LLMEngine
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.runner.model_runner import ModelRunner

    from .fakes import CharTokenizer

    kind, path, hf = family
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 25)]
    expected = []
    for p in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(ref[0, len(p) :].tolist())
    # a window on every layer (Mistral, Phi-3): blocks out of it are handed back while requests decode,
    # through both attention paths; Gemma's global layers keep every block
    windowed = kind in ("mistral", "phi3")
    for name, backend in backends() if windowed else backends()[-1:]:
        ours = load_model(path, backend)
        assert ours.config.release_window == (WINDOW if windowed else 0)
        runner = ModelRunner(ours, allocate_kv_cache(ours.config, 64, BLOCK_SIZE), BLOCK_SIZE)
        blocks = BlockManager(64, BLOCK_SIZE, window=ours.config.release_window)
        engine = LLMEngine(runner, CharTokenizer(), blocks, SchedulerConfig(4, 16, 256))
        reqs = []
        for i, p in enumerate(prompts):  # staggered: later ones join while earlier ones decode; 16-token chunks
            reqs.append(engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
            engine.step()
        while engine.has_work():
            engine.step()
            blocks.check_integrity()
        assert (blocks.released_blocks > 0) == windowed and blocks.num_used_blocks == 0
        for p, r, want in zip(prompts, reqs, expected):
            assert r.output_token_ids == want, (kind, name, p)


def test_the_triton_path_runs_the_families(family):
    """Sliding windows (per layer for Gemma), soft-capped scores (Gemma 2) and q/k norms through the Triton
    kernels (compiled on a GPU, the interpreter on CPU). The families whose attention has those (Mistral's window
    is Gemma's; Phi-3's and Gemma 3 vision's text forwards are Llama's and Gemma 3's)."""
    if family[0] not in ("qwen3", "gemma2", "gemma3"):
        pytest.skip("no attention feature of its own: another family's run covers it")
    pytest.importorskip("triton")
    from minibatch.engine.attention.triton_backend import TritonAttentionBackend
    from minibatch.engine.models.ops import TritonOps

    kind, path, hf = family
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = load_model(path, TritonAttentionBackend(), device=device, packed=False, ops=TritonOps())
    bs = 8  # the GPU kernels' smallest block
    seqs = [list(range(3, 3 + n)) for n in (14, 6)]
    tables = [[3, 1, 5], [2, 6, 4]]
    caches = allocate_kv_cache(ours.config, 7, bs, device=device)
    batch = build_flat_batch(seqs, [0, 0], tables, bs, device)
    with torch.no_grad():
        logits = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn)).cpu()
    torch.testing.assert_close(logits[:14], hf_logits(hf, seqs[0]), atol=1e-4, rtol=0)
    for _ in range(6):
        nxt = [int(hf_logits(hf, s)[-1].argmax()) for s in seqs]
        batch = build_flat_batch([[t] for t in nxt], [len(s) for s in seqs], tables, bs, device)
        with torch.no_grad():
            step = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn)).cpu()
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            torch.testing.assert_close(step[i], hf_logits(hf, seqs[i])[-1], atol=1e-4, rtol=0)


def test_longrope_past_its_original_length_rotates_every_position_with_the_long_factors(tmp_path):
    """A context set past Phi-3's original length switches the whole run to the long factors (llama.cpp's
    rule: cached keys never mix the two); HF does the same for a sequence that long."""
    path = _save("phi3", tmp_path / "phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(range(3, 3 + 90))  # past the original 64
    for name, backend in backends():
        ours = load_model(path, backend)
        ours.use_context(256)
        assert ours.model.rotary.long and ours.model.rotary.cos.shape[0] == 256
        caches = allocate_kv_cache(ours.config, 32, BLOCK_SIZE)
        tables = [list(range(1, 31))]
        outs = []
        for start, end in ((0, 70), (70, 90)):  # a prefill, then a chunk over the cached context
            b = build_flat_batch([ids[start:end]], [start], tables, BLOCK_SIZE)
            with torch.no_grad():
                outs.append(ours.compute_logits(ours(b.input_ids, b.positions, caches, b.attn)))
        torch.testing.assert_close(torch.cat(outs), hf_logits(hf, ids), atol=1e-4, rtol=0, msg=name)
        ours.use_context(64)  # back at the original length: the short factors again
        assert not ours.model.rotary.long
        ours.use_context(256, positions=96)  # a pool of 96 tokens: the long factors, 96 rows of them
        assert ours.model.rotary.long and ours.model.rotary.cos.shape[0] == 96
