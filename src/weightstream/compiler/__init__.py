"""weightstream.compiler."""
