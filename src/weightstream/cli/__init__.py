"""weightstream.cli."""
