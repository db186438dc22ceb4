"""Running the model: the runner that turns a scheduler step into one forward, the sampler, the KV cache
tensors and the captured CUDA graphs."""
