"""The Hugging Face transformers model with the same weights as ours: the reference for parity
tests and the baseline in benchmarks. A GGUF source gets its tensors dequantised by gguf.quants."""

from __future__ import annotations

from pathlib import Path

import torch

from minibatch.engine.models.config import ModelConfig
from minibatch.engine.weights.loader import WeightLoadError, gguf_source


def load_hf_reference(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    import transformers

    model_dir = Path(model_dir)
    gguf = gguf_source(model_dir)
    if gguf is None:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    from minibatch.engine.gguf.tensors import GGUFWeights

    config = transformers.AutoConfig.from_pretrained(model_dir)
    try:  # every weight is loaded below (strictly): not drawn at random first (3 s for a 135M model)
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - an older transformers: initialised, then overwritten
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = GGUFWeights(gguf, ModelConfig.from_dir(model_dir))
    state = {name: t.dequantized().to(dtype) for name, t in weights.tensors.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise WeightLoadError(f"reference model: missing {missing}, unexpected {result.unexpected_keys}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
