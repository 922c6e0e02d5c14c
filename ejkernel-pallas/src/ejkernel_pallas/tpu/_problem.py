"""The static geometry of one Mosaic TPU flash-attention launch: blocks sized to the VMEM
budget, the kernel layout ([B, H, S_pad, D_pad]) and padded segment ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel import env
from ejkernel.attention_semantics import Geometry, Tiling
from ejkernel_pallas import _compat
from ejkernel_pallas._attention import FlashAttentionConfig, Shapes

LANES = 128
SUBLANES = 8
#: Default (q, kv) blocks of the forward and the backward, before the VMEM budget.
FWD_BLOCKS = (512, 512)
BWD_BLOCKS = (256, 512)
#: Bytes one grid step may hold in VMEM (inputs double-buffered, scratch, f32 temporaries);
#: below the 16 MiB scoped default of v4/v5e so the compiler keeps its own headroom.
VMEM_BUDGET = 12 * 2**20


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def vmem_bytes(bq: int, bk: int, d: int, dv: int, itemsize: int, backward: bool) -> int:
    """Rough VMEM of one grid step: double-buffered blocks, scratch, f32 [bq, bk] temporaries."""
    d, dv = round_up(d, LANES), round_up(dv, LANES)
    blocks = (bq * d + bk * (d + dv)) * itemsize + bq * dv * itemsize + 2 * bq * LANES * 4
    if backward:
        blocks += bq * dv * itemsize + bq * LANES * 4
        scratch = (bq * d + bk * (d + dv)) * 4
        temps = 5 * bq * bk * 4
    else:
        scratch = bq * dv * 4 + 2 * bq * LANES * 4
        temps = 3 * bq * bk * 4
    return 2 * blocks + scratch + temps


def fit_blocks(pair: tuple[int, int], s: Shapes, *, backward: bool) -> tuple[int, int]:
    """Blocks legal on TPU (q: 8 sublanes, kv: 128 lanes), no longer than the padded sequences,
    halved (kv first) until a grid step fits :data:`VMEM_BUDGET`."""
    bq = max(SUBLANES, min(round_up(pair[0], SUBLANES), round_up(s.sq, SUBLANES)))
    bk = max(LANES, min(round_up(pair[1], LANES), round_up(s.sk, LANES)))
    while vmem_bytes(bq, bk, s.d, s.dv, 4, backward) > VMEM_BUDGET:
        if bk > LANES and bk >= bq:
            bk = round_up(bk // 2, LANES)
        elif bq > SUBLANES:
            bq = round_up(bq // 2, SUBLANES)
        else:
            break
    return bq, bk


@attrs.frozen(kw_only=True)
class Problem(Tiling):
    """Everything static about one launch (hashable: it parametrises the kernels)."""

    b: int
    hq: int
    hkv: int
    d: int
    dv: int
    d_pad: int
    dv_pad: int
    scale: float
    cap: float | None
    geo: Geometry
    segments: bool
    dtype: Any

    @classmethod
    def of(
        cls,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        q_segment_ids: jax.Array | None,
        statics: Mapping[str, Any],
        *,
        backward: bool,
    ) -> Problem:
        """The launch of one call, from its arrays and its statics (``cfg``,
        ``softmax_scale``, ``causal``, ``sliding_window``, ``logits_soft_cap``; absent: the
        defaults)."""
        s = Shapes.of(query, key, value)
        cfg: FlashAttentionConfig | None = statics.get("cfg")
        params = None if cfg is None else (cfg.bwd_params if backward else cfg.fwd_params)
        default = BWD_BLOCKS if backward else FWD_BLOCKS
        pair = (
            (params.q_blocksize if params and params.q_blocksize else default[0]),
            (params.kv_blocksize if params and params.kv_blocksize else default[1]),
        )
        bq, bk = fit_blocks(pair, s, backward=backward)
        scale, cap = statics.get("softmax_scale"), statics.get("logits_soft_cap")
        geo = Geometry.of(
            query, key, causal=bool(statics.get("causal")), window=statics.get("sliding_window")
        )
        return cls(
            **attrs.asdict(s),
            d_pad=round_up(s.d, LANES),
            dv_pad=round_up(s.dv, LANES),
            bq=bq,
            bk=bk,
            scale=float(s.d**-0.5 if scale is None else scale),
            cap=None if cap is None else float(cap),
            geo=geo,
            segments=q_segment_ids is not None,
            dtype=jnp.dtype(query.dtype),
        )

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def interpret(self) -> Any:
        """TPU interpret parameters on the CPU (only reachable with EJKERNEL_INTERPRET=1)."""
        if jax.default_backend() == "tpu" and not env.interpret():
            return False
        return _compat.tpu_interpret_params()


def pad_to(x: jax.Array, shape: tuple[int, ...], fill: Any = 0) -> jax.Array:
    widths = [(0, t - s) for s, t in zip(x.shape, shape)]
    if all(w == (0, 0) for w in widths):
        return x
    return jnp.pad(x, widths, constant_values=fill)


def to_kernel_layout(
    query: jax.Array, key: jax.Array, value: jax.Array, pr: Problem
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, S, H, D] -> [B, H, S_pad, D_pad] (zero padding)."""
    q = pad_to(jnp.swapaxes(query, 1, 2), (pr.b, pr.hq, pr.sq_pad, pr.d_pad))
    k = pad_to(jnp.swapaxes(key, 1, 2), (pr.b, pr.hkv, pr.sk_pad, pr.d_pad))
    v = pad_to(jnp.swapaxes(value, 1, 2), (pr.b, pr.hkv, pr.sk_pad, pr.dv_pad))
    return q, k, v


def from_kernel_layout(out: jax.Array, pr: Problem) -> jax.Array:
    return jnp.swapaxes(out[:, :, : pr.sq, : pr.dv], 1, 2)


def kernel_segments(
    q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None, pr: Problem
) -> tuple[jax.Array, jax.Array] | None:
    """Query ids [B, Sq_pad, 128] (lanes replicated), key ids [B, 8, Sk_pad] (sublanes
    replicated); padding carries id -1, which sees nothing."""
    if q_segment_ids is None or kv_segment_ids is None:
        return None
    qs = pad_to(q_segment_ids.astype(jnp.int32), (pr.b, pr.sq_pad), -1)
    ks = pad_to(kv_segment_ids.astype(jnp.int32), (pr.b, pr.sk_pad), -1)
    qs = jnp.broadcast_to(qs[:, :, None], (pr.b, pr.sq_pad, LANES))
    ks = jnp.broadcast_to(ks[:, None, :], (pr.b, SUBLANES, pr.sk_pad))
    return qs, ks
