"""Pallas kernels lowered through Mosaic TPU (run on CPU in TPU interpret mode)."""
