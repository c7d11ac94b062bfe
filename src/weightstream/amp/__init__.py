"""weightstream.amp."""
