"""The model forwards (Llama family) and their elementwise ops; weights load through minibatch.engine.weights."""

from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig", "UnsupportedModelError"]
