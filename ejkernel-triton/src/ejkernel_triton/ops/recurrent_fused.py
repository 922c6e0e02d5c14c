"""The fused recurrent (one token at a time) forward of gla-form linear attention, for decoding.

:func:`fused_forward` serves ``gla``, ``recurrent`` and ``lightning_attention`` (each maps its
gates onto the key gate ``g [B, S, H, K]``) when their config says ``fused``: the heuristic
picks it for a few tokens with a carried state (``S ≤``
:data:`ejkernel_triton.ops.gla_config.FUSED_GPU_MAX_TOKENS` on a GPU, :data:`FUSED_MAX_TOKENS`
in the interpreter). It is the
primal only: a differentiated call runs the chunked forward, whose residuals the backward
reads. The kernel is :mod:`ejkernel_triton.kernels.recurrent_fused`; its launch,
:func:`fused_launch`, also runs kernel_delta_attention's fused kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_triton import _launch
from ejkernel_triton._launch import BATCH, OTHER, pow2

__all__ = ["FUSED_MAX_TOKENS", "fused_forward", "fused_launch", "fused_states"]

#: The heuristic's longest call (tokens per row, or in all when packed) for the fused path in
#: the interpreter (on a GPU: ``gla_config.FUSED_GPU_MAX_TOKENS``).
FUSED_MAX_TOKENS = 16


def fused_forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    *,
    initial_state: jax.Array | None,
    cu_seqlens: jax.Array | None,
    scale: float,
    block_v: int,
    num_warps: int,
    return_state: bool,
) -> Any:
    """``out [B, S, H, V]`` (query dtype), or ``(out, final_state [N, H, K, V] float32)``."""
    init, cu = fused_states(query, value, initial_state, cu_seqlens)
    out, final = _run(
        query,
        key,
        value,
        g.astype(jnp.float32),
        init,
        cu,
        scale=float(scale),
        block_v=block_v,
        num_warps=num_warps,
        packed=cu_seqlens is not None,
    )
    return (out, final) if return_state else out


def fused_states(
    query: jax.Array,
    value: jax.Array,
    initial_state: jax.Array | None,
    cu_seqlens: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """A fused kernel's state rows and offsets: ``init [N, H, K, V]`` float32 (zeros without
    ``initial_state``) and ``cu`` int32 (two zeros, unread, without ``cu_seqlens``)."""
    b, _, h, dk = query.shape
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = (
        jnp.zeros((n, h, dk, value.shape[-1]), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )
    cu = jnp.zeros((2,), jnp.int32) if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    return init, cu


def fused_launch(
    kernel: Any,
    *arrays: jax.Array,
    scale: float,
    block_v: int,
    num_warps: int,
    packed: bool,
    **constexprs: Any,
) -> tuple[jax.Array, jax.Array]:
    """One launch of a fused recurrent kernel, ``(out [B, S, H, V], final rows [N, H, K, V]
    float32)``: ``arrays`` are ``(q, k, v, …, init, cu)`` in the kernel's order, one program per
    ``block_v`` values of a state row and head; ``constexprs`` are the kernel's own beyond the
    sizes ``K``, ``V``, ``BK``, ``BV`` and ``PACKED``. Vmappable: a dense call folds a mapped
    axis into the batch, a packed one runs once per index.

    The final rows alias ``init`` (each program reads its state tile before it writes it), so
    a state carried through ``lax.scan`` or donated to the call is updated in place: the
    kernel's read and write are the step's only traffic on it. An undonated state is copied
    first, by XLA."""
    q, v = arrays[0], arrays[2]
    dk, dv = q.shape[-1], v.shape[-1]

    def run(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        q, init = arrays[0], arrays[-2]
        b, s, h, _ = q.shape
        return tuple(
            _launch.launch(
                kernel,
                *arrays,
                np.float32(scale),
                s,
                h,
                out_shape=[
                    jax.ShapeDtypeStruct((b, s, h, dv), q.dtype),
                    jax.ShapeDtypeStruct(init.shape, jnp.float32),
                ],
                grid=(-(-dv // block_v), init.shape[0], h),
                zeroed_outputs=(0,) if packed else (),
                input_output_aliases={len(arrays) - 2: 1},
                K=dk,
                V=dv,
                BK=pow2(dk),
                BV=block_v,
                PACKED=packed,
                **constexprs,
                num_warps=num_warps,
                num_stages=1,
            )
        )

    n = len(arrays)
    modes = (OTHER,) * n if packed else (BATCH,) * (n - 1) + (OTHER,)
    out, final = _launch.fold_vmap(run, modes)(*arrays)
    return out, final


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "num_warps", "packed"))
def _run(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    init: jax.Array,
    cu: jax.Array,
    *,
    scale: float,
    block_v: int,
    num_warps: int,
    packed: bool,
) -> tuple[jax.Array, jax.Array]:
    """The gla-form kernel's launch."""
    from ejkernel_triton.kernels.recurrent_fused import recurrent_fused_fwd_kernel

    bv = min(block_v, pow2(v.shape[-1]))
    return fused_launch(
        recurrent_fused_fwd_kernel,
        q,
        k,
        v,
        g,
        init,
        cu,
        scale=scale,
        block_v=bv,
        num_warps=num_warps,
        packed=packed,
    )
