"""weightstream.models."""
