"""Pallas kernels lowered through Mosaic GPU, for Hopper GPUs (sm_90)."""
