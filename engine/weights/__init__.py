"""Weights into a model: safetensors or GGUF files by name, quantized blocks kept as they are on CPU
(`loader.load_model`)."""
