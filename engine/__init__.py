"""minibatch's engine: requests, KV blocks, schedulers, the model runner and the models."""
