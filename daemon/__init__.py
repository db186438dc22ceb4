"""minibatch.daemon."""
