"""governor package (see README)."""
