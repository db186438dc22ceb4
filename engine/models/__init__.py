"""Model definitions and weight loading."""

from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .loader import WeightLoadError, load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "UnsupportedModelError", "WeightLoadError", "load_model"]
