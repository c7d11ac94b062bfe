"""weightstream.data."""
