"""Next milestone (see README)."""
