"""flash_attention (Triton): the launches of the specialized variants (Hopper): the
warp-specialized forward, dK/dV and dQ kernels and the Gluon ping-pong forward and backward.
They take the plain case only (:func:`ejkernel_triton.ops.flash_attention_config.fwd_problem`
and ``bwd_problem`` say which calls), the TMA descriptors' scratch and, for the Gluon
backward, the row statistics padded to whole query blocks; the usual kernels' launches and
the dispatch by variant are in :mod:`ejkernel_triton.ops.flash_attention`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import finite_or_zero
from ejkernel_triton import _launch
from ejkernel_triton.ops.flash_attention_config import clamp, persistent_programs

if TYPE_CHECKING:
    from ejkernel_triton.ops.flash_attention import _Statics

__all__ = [
    "bwd_gluon",
    "dkdv_ws",
    "dq_ws",
    "forward_pingpong",
    "forward_ws",
    "launch_specialized",
    "masked_loop_kv",
]


def launch_specialized(
    st: _Statics,
    kernel: Any,
    arrays: tuple[jax.Array, ...],
    out_shape: list[jax.ShapeDtypeStruct],
    grid: tuple[int, ...],
    params: Any,
    *extra: int,
    zeroed_outputs: tuple[int, ...] = (),
    **constexprs: Any,
) -> list[Any]:
    """Launch a warp-specialized kernel: its arrays, the scalars all three take (scale, soft
    cap, B, Sq, Sk, Hq, Hkv), ``extra`` ones, its outputs (those of ``zeroed_outputs`` set to
    zero first) and the per-program scratch its TMA descriptors live in (dropped from the
    result)."""
    from ejkernel_triton._kernel_cache import GLOBAL_SCRATCH_BYTES

    q, k = arrays[0], arrays[1]
    (b, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    *outs, _ = _launch.launch(
        kernel,
        *arrays,
        *st.scale_and_cap(),
        b,
        sq,
        sk,
        hq,
        hkv,
        *extra,
        out_shape=[
            *out_shape,
            jax.ShapeDtypeStruct((math.prod(grid) * GLOBAL_SCRATCH_BYTES,), jnp.int8),
        ],
        grid=grid,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
        zeroed_outputs=zeroed_outputs,
        HEAD_DIM=d,
        CAUSAL=st.causal,
        SOFT_CAP=st.soft_cap is not None,
        **constexprs,
    )
    return outs


def masked_loop_kv(st: _Statics, k: jax.Array, v: jax.Array, bk: int) -> tuple[Any, Any]:
    """K and V for a warp-specialized kernel's key loop: through ``finite_or_zero`` where the
    loop masks its blocks (causal, or a cut last block, whose keys are the next batch's), so a
    hidden NaN or Inf reaches no row through ``0 · NaN``. Here, not in the loop: Triton's
    warp specialization fails on any operation between a tile's TMA load and its matmul."""
    if st.causal or k.shape[1] % bk:
        return finite_or_zero(k), finite_or_zero(v)
    return k, v


def forward_ws(
    st: _Statics,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lists: tuple[jax.Array, jax.Array, list[int]] | None = None,
    tile: tuple[int, int, Any] | None = None,
) -> list[Any]:
    """Output and lse by ``flash_attention_fwd_ws_kernel``, persistent: one program per SM
    walks the (query block, batch·head) tiles. ``lists``: a block-sparse call's ``(index,
    counts, their batch and head strides)``, walked in ``tile = (rows, keys, params)`` (the
    mask's blocks, the variant's warps and stages); ``None``: every key block a tile may see,
    in the config's tiles (``st.fwd``)."""
    from ejkernel_triton.kernels.flash_attention_fwd import flash_attention_fwd_ws_kernel

    (b, sq, hq, _), sk = q.shape, k.shape[1]
    params = st.fwd if tile is None else tile[2]
    bq, bk = tile[:2] if tile else (clamp(params.q_blocksize, sq), clamp(params.kv_blocksize, sk))
    index, counts, strides = lists or _unlisted()
    return launch_specialized(
        st,
        flash_attention_fwd_ws_kernel,
        (q, *masked_loop_kv(st, k, v, bk), index, counts),
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)],
        (min(_cdiv(sq, bq) * b * hq, persistent_programs()),),
        params,
        index.shape[-1],
        *strides,
        BLOCK_M=bq,
        BLOCK_N=bk,
        EVEN_K=sk % bk == 0,
        LISTED=lists is not None,
    )


def forward_pingpong(st: _Statics, q: jax.Array, k: jax.Array, v: jax.Array) -> list[Any]:
    """Output and lse by the Gluon kernel ``flash_attention_fwd_pingpong_kernel`` (FA3's
    schedule; the GPU only): one program per 128-row query tile and batch·head."""
    from ejkernel_triton.kernels.flash_attention_hopper_fwd import (
        flash_attention_fwd_pingpong_kernel,
    )

    (b, sq, hq, _), sk = q.shape, k.shape[1]
    params = st.fwd
    return launch_specialized(
        st,
        flash_attention_fwd_pingpong_kernel,
        (q, k, v),
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)],
        (_cdiv(sq, params.q_blocksize), b * hq),
        params,
        BLOCK_N=params.kv_blocksize,
        STAGES=params.num_stages,
        EVEN_K=sk % params.kv_blocksize == 0,
        HEAD_GROUP=st.fwd_head_group if st.causal else 0,
    )


def dkdv_ws(st: _Statics, q, k, v, do, lse, delta, lists=None, tile=None) -> list[Any]:
    """dK and dV by ``flash_attention_bwd_dkdv_ws_kernel``; ``lists`` (a block-sparse call's
    by-key lists, as :func:`forward_ws`'s) walked with ``tile = (query block rows, keys,
    params)``: the mask's blocks, the variant's params."""
    from ejkernel_triton.kernels.flash_attention_bwd import flash_attention_bwd_dkdv_ws_kernel

    sq, (b, sk, hkv, _) = q.shape[1], k.shape
    params = st.bwd if tile is None else tile[2]
    bq = clamp(params.q_blocksize, sq)  # query rows a step: half a mask block when listed
    bk = tile[1] if tile else clamp(params.kv_blocksize, sk)
    index, counts, strides = lists or _unlisted()
    return launch_specialized(
        st,
        flash_attention_bwd_dkdv_ws_kernel,
        (q, k, v, do, lse, delta, index, counts),
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        (_cdiv(sk, bk), b * hkv),
        params,
        index.shape[-1],
        *strides,
        BLOCK_M=bq,
        BLOCK_N=bk,
        LISTED=lists is not None,
        BQ=tile[0] if tile else 0,
    )


def bwd_gluon(st: _Statics, q, k, v, do, lse, delta, fuse_dq: bool = True) -> Any:
    """``(dQ, dK, dV)`` by the Gluon kernel ``flash_attention_bwd_gluon_kernel`` (the GPU only):
    one program per 128 keys and batch·key head; lse and delta padded to whole query blocks
    (the loader brings them by TMA); dQ accumulates in float32 across the key blocks' programs
    (TMA reduce-adds) and is scaled and cast here. Without ``fuse_dq`` only dK and dV (dQ is
    ``None``)."""
    from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE
    from ejkernel_triton.kernels.flash_attention_hopper_bwd import flash_attention_bwd_gluon_kernel

    sq, (b, sk, hkv, _) = q.shape[1], k.shape
    params = st.bwd
    bm = params.q_blocksize
    stats_len = _cdiv(sq, bm) * bm
    if stats_len != sq:
        pad = ((0, 0), (0, 0), (0, stats_len - sq))
        lse = jnp.pad(lse, pad, constant_values=EMPTY_LSE.value)
        delta = jnp.pad(delta, pad)
    dk, dv, dq = launch_specialized(
        st,
        flash_attention_bwd_gluon_kernel,
        (q, k, v, do, lse, delta),
        [
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(q.shape if fuse_dq else (1,), jnp.float32),
        ],
        (_cdiv(sk, params.kv_blocksize), b * hkv),
        params,
        stats_len,
        zeroed_outputs=(2,) if fuse_dq else (),
        BLOCK_M=bm,
        STAGES=params.num_stages,
        HEAD_GROUP=st.bwd_head_group if st.causal else 0,
        FUSE_DQ=fuse_dq,
    )
    return ((dq * st.sm_scale).astype(q.dtype) if fuse_dq else None), dk, dv


def dq_ws(st: _Statics, q, k, v, do, lse, delta, lists=None, tile=None) -> Any:
    """dQ by ``flash_attention_bwd_dq_ws_kernel``; ``lists`` (a block-sparse call's, as
    :func:`forward_ws`'s) walked in ``tile = (rows, keys, params)``, the mask's blocks."""
    from ejkernel_triton.kernels.flash_attention_bwd import flash_attention_bwd_dq_ws_kernel
    from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE

    (b, sq, hq, _), sk = q.shape, k.shape[1]
    params = st.dq if tile is None else tile[2]
    bq, bk = tile[:2] if tile else (clamp(params.q_blocksize, sq), clamp(params.kv_blocksize, sk))
    index, counts, strides = lists or _unlisted()
    blocks = _cdiv(sq, bq)
    if blocks * bq != sq:  # whole blocks of row statistics
        pad = ((0, 0), (0, 0), (0, blocks * bq - sq))
        lse = jnp.pad(lse, pad, constant_values=EMPTY_LSE.value)
        delta = jnp.pad(delta, pad)
    (dq,) = launch_specialized(
        st,
        flash_attention_bwd_dq_ws_kernel,
        (q, *masked_loop_kv(st, k, v, bk), do, lse, delta, index, counts),
        [jax.ShapeDtypeStruct(q.shape, q.dtype)],
        (blocks, b * hq),
        params,
        blocks * bq,
        index.shape[-1],
        *strides,
        BLOCK_M=bq,
        BLOCK_N=bk,
        EVEN_K=sk % bk == 0,
        HEAD_GROUP=st.bwd_head_group if st.causal and lists is None else 0,
        LISTED=lists is not None,
    )
    return dq


def _unlisted() -> tuple[jax.Array, jax.Array, list[int]]:
    """What a kernel that can walk block lists takes when it walks none: placeholder lists
    (never read), zero strides."""
    none = jnp.zeros((1,), jnp.int32)
    return none, none, [0, 0, 0, 0]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
