"""Compile-only probe (a CPU is enough): can a Gluon kernel reduce a shared-memory tile into
global memory by TMA (``cp.reduce.async.bulk.tensor ... .add``), as FlashAttention-3's
backward accumulates dQ? Gluon 3.6's Hopper ``tma`` module exposes no reduce, but its op
builder has ``create_async_tma_reduce``; a three-line builtin reaches it."""

import json
import sys

import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord:] += src`` (a shared-memory tile) by TMA; ``tma.store_wait`` waits."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def dq_accumulate_kernel(Acc, rows, cols, GlobalScratch, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """Each program adds a [BLOCK_M, D] float32 tile of ones (from registers, through shared
    memory) into ``Acc`` at its rows: the pattern of a fused backward's dQ."""
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.float32)
    desc = tma.make_tensor_descriptor(
        Acc, shape=[rows, cols], strides=[cols, 1], block_shape=[BLOCK_M, D], layout=sl
    )
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    tile = gl.full([BLOCK_M, D], 1.0, gl.float32, layout)
    smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D], sl, tile)
    fence_async_shared()
    tma_reduce_add(desc, [gl.program_id(0) * BLOCK_M, 0], smem)
    tma.store_wait(0)


if __name__ == "__main__":
    src = GluonASTSource(
        dq_accumulate_kernel,
        {
            "Acc": "*fp32",
            "rows": "i32",
            "cols": "i32",
            "GlobalScratch": "*i8",
            "BLOCK_M": "constexpr",
            "D": "constexpr",
        },
        constexprs={"BLOCK_M": 64, "D": 128},
        attrs={(0,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]},
    )
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    lines = [ln.strip() for ln in k.asm["ptx"].splitlines() if "cp.reduce.async.bulk" in ln]
    print(json.dumps({"reduce_instructions": lines, "shared": k.metadata.shared}))
    sys.exit(0 if lines else 1)
