"""The model forwards (Llama family) and their elementwise ops; weights load through minibatch.engine.weights."""
