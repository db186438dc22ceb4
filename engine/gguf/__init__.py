"""GGUF files: the reader, the tensors as our forward names them, the architectures we run, and the config and
tokenizer files prepared from a file's metadata."""
