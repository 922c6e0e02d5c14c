"""ejkernel's Triton backend: flash attention kernels launched through jax-triton.

Importing this package imports neither triton nor jax-triton; :mod:`ejkernel_triton.plugin`
registers the implementations lazily and :func:`ejkernel_triton.plugin.available` probes the
machine on first use.
"""

__version__ = "1.0.0"
