"""minibatch.tui."""
