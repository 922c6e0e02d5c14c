"""Shared memory of this plugin's Triton kernels: the device's limit, and how Triton fills it.

Triton (3.6, sm_80-sm_90) keeps in shared memory the tiles a kernel's loop streams, one buffer
per pipeline stage (``num_stages``), plus the tiles loaded once before the loop that feed a
matrix instruction; what stays in registers (accumulators, row vectors of the program's own
rows) takes none. A kernel's figure is therefore the sum of its once-loaded operand tiles and
``num_stages`` times its streamed tiles (the flash-attention kernels' formulas:
:func:`ejkernel_triton.ops.flash_attention_config.fwd_smem` and ``bwd_smem``, checked against
what Triton allocates for sm_90 by ``tests/triton/test_smem.py``, on any machine).
"""

from __future__ import annotations

from ejkernel.ops import shared_memory_limit

__all__ = ["HOPPER", "launch_limit"]

#: Hopper's shared memory per block (227 KiB, opt-in maximum): the target of kernels compiled
#: without a GPU (``ejkernel_triton._codegen`` compiles for sm_90).
HOPPER = 232448


def launch_limit() -> int:
    """Bytes a launch may fill: the device's (:func:`ejkernel.ops.shared_memory_limit`), or
    Hopper's where no GPU says (the interpreter, compiling for a GPU elsewhere)."""
    return shared_memory_limit() or HOPPER
