"""router package (see README)."""
