"""Weights into a model: safetensors or GGUF files by name, quantized blocks kept as they are on CPU."""

from .loader import WEIGHT_MODES, WeightLoadError, load_model

__all__ = ["WEIGHT_MODES", "WeightLoadError", "load_model"]
