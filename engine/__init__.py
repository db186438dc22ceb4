"""minibatch's engine: core/ (torch-free: requests, KV blocks, schedulers, the step loop), the model runner,
the model store and sources, models/ (the forwards) and weights/ (loading, quantized modules)."""
