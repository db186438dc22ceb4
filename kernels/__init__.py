"""minibatch.kernels."""
