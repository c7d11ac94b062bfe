"""weightstream.utils."""
