"""agents package (see README)."""
