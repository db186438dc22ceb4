"""The model architectures our forward runs, by the names GGUF files give them (`general.architecture`)."""

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
