"""The shared memory of a Mosaic GPU kernel: its scratch described once, as plain values, so
the launch builds it and the config space counts it from the same description.

How Pallas on Mosaic GPU lays it out (``jax._src.pallas.mosaic_gpu.lowering``, jax 0.10-0.11):
each scratch buffer of ``plgpu.kernel`` is a ``run_scoped`` allocation in one dynamic
shared-memory block, its size rounded up to ``SMEM_ALIGNMENT`` (1024 bytes, what a 128-byte
swizzle needs), the buffers one after another; the mbarriers follow, 8 bytes each; reductions
add ``reduction_scratch_bytes`` (0 in these kernels). So a kernel needs

    sum(align_up(prod(shape) * itemsize, 1024) for each buffer) + 8 * barriers

bytes, which Mosaic GPU compares with the device's ``shared_memory_per_block_optin``. On an
H200 (limit 232,448) at D 128: the dK/dV kernel of blocks (64, 128, 2 stages) under GQA needs
2·32,768 (K, V) + 2·16,384 (Q, dO rings) + 2·1,024 (logsumexp, Δ rings of 512 bytes) +
131,072 (its float32 outputs) + 8·14 = 329,840; the dQ kernel of (64, 128, 3 stages) needs
2·16,384 (Q, dO) + 2·1,024 (logsumexp, Δ) + 2·98,304 (K, V rings) + 8·17 = 264,328.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import jax.numpy as jnp

__all__ = ["ALIGNMENT", "BARRIER_BYTES", "Barriers", "Buffer", "build", "nbytes"]

#: Bytes each scratch buffer is rounded up to (``gpu_core.SMEM_ALIGNMENT``).
ALIGNMENT = 1024
#: Bytes of one mbarrier.
BARRIER_BYTES = 8


@attrs.frozen
class Buffer:
    """A shared-memory buffer: ``tiled`` ones carry the 128-byte swizzle the wgmma reads."""

    shape: tuple[int, ...]
    dtype: Any
    tiled: bool = True

    @property
    def nbytes(self) -> int:
        size = math.prod(self.shape) * jnp.dtype(self.dtype).itemsize
        return -(-size // ALIGNMENT) * ALIGNMENT


@attrs.frozen
class Barriers:
    """``num_barriers`` mbarriers, each completing after ``num_arrivals`` arrivals."""

    num_barriers: int
    num_arrivals: int = 1

    @property
    def nbytes(self) -> int:
        return self.num_barriers * BARRIER_BYTES


def nbytes(scratch: Any) -> int:
    """Shared memory of a scratch description (buffers and barriers, nested in tuples and
    lists), as Mosaic GPU allocates it."""
    if isinstance(scratch, list | tuple):
        return sum(nbytes(s) for s in scratch)
    return int(scratch.nbytes)


def build(pr: Any, scratch: Any) -> Any:
    """The ``plgpu`` scratch objects of a description, in its nesting."""
    from ejkernel_pallas import _compat
    from ejkernel_pallas.gpu import _mosaic as mg

    if isinstance(scratch, list | tuple):
        return type(scratch)(build(pr, s) for s in scratch)
    if isinstance(scratch, Barriers):
        return _compat.plgpu().Barrier(
            num_arrivals=scratch.num_arrivals, num_barriers=scratch.num_barriers
        )
    return mg.smem(pr, scratch.shape, scratch.dtype, tiled=scratch.tiled)
