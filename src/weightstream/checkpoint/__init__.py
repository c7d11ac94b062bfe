"""weightstream.checkpoint."""
