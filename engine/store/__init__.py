"""Where models come from: the cache of prepared models (`resolve_model`) and the local sources it finds
(Ollama's store, the Hugging Face cache, a models folder)."""
