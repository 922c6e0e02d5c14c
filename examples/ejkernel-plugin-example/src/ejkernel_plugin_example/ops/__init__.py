"""Implementations on the ``example`` platform (one module per op)."""
