"""weightstream.metrics."""
