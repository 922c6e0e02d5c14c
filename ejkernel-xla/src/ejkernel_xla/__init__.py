"""ejkernel-xla: every ejkernel op in pure JAX, memory-efficient, with custom VJPs."""

__version__ = "1.0.0"
