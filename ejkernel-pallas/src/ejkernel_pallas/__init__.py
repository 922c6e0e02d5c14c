"""ejkernel-pallas: Pallas kernels for TPU (Mosaic TPU) and Hopper GPUs (Mosaic GPU).

Importing this package imports nothing heavy; the kernels live in ``ejkernel_pallas.tpu`` and
``ejkernel_pallas.gpu`` and load when an op first selects them.
"""

__version__ = "1.0.0"
