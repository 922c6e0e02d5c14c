"""The ops of the XLA backend, one module per op (pure JAX, blockwise, custom VJPs)."""
