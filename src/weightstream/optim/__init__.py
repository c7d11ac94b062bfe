"""weightstream.optim."""
