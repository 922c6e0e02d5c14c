"""One module per op served by the CUDA platform (imported on first use only)."""
