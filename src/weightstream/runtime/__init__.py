"""weightstream.runtime."""
