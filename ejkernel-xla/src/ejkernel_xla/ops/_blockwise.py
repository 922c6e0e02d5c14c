"""The blockwise attention engine shared by the XLA attention ops (flash, ring, MLA, ...).

FlashAttention-2 (Dao, 2023) in pure JAX, as pieces an op assembles: the blocked layout
(queries ``[nq, B, Hkv, G, bq, F]``, keys/values ``[nk, B, Hkv, bk, F]``, a sequence padded
to whole blocks), loop helpers that resolve statically when they can, the logits of a block
(soft cap, bias, mask by select), one online-softmax step (Alg. 1, Sec. 3.1.1) and the
finish of a row (sinks, division, logsumexp), and the backward's blocked rows and the
gradients of one tile (Alg. 2). What is visible and what a hidden position
contributes (nothing, whatever it holds) is :mod:`ejkernel.attention_semantics`; this
module only lays it out in blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import (
    EMPTY_ROW_LSE,
    MASK_VALUE,
    Geometry,
    Tiling,
    mask_scores,
    soft_cap,
    soft_cap_grad,
    visible,
)
from ejkernel_xla.ops import _tuning, _vma

__all__ = [
    "BackwardRows",
    "Blocking",
    "SideInputs",
    "as_4d",
    "backend",
    "block_gradients",
    "block_scores",
    "block_visibility",
    "dot",
    "finish_rows",
    "initial_rows",
    "kv_blocks",
    "map_blocks",
    "online_step",
    "pad_axis",
    "q_blocks",
    "scan",
    "segment_blocks",
    "take",
    "tile_may_see",
    "unblock_kv",
    "unblock_q",
    "when",
    "when_else",
]


def backend() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the default backend's family (``cpu`` if unknown)."""
    return _tuning.backend(("cpu", "gpu", "tpu"))


@attrs.frozen(kw_only=True)
class Blocking(Tiling):
    """Sizes of one call and its blocking (all Python ints): the tiling, batch, heads, head dims."""

    b: int
    hq: int
    hkv: int
    d: int
    dv: int

    @classmethod
    def of(cls, q: jax.Array, k: jax.Array, v: jax.Array, bq: int, bk: int) -> Blocking:
        b, sq, hq, d = q.shape
        _, sk, hkv, _ = k.shape
        return cls(b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=v.shape[3], bq=bq, bk=bk)

    @property
    def group(self) -> int:
        return self.hq // self.hkv


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def pad_axis(x: jax.Array, axis: int, size: int, fill: Any = 0) -> jax.Array:
    """``x`` padded with ``fill`` at the end of ``axis`` to length ``size`` (if shorter)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=fill)


def q_blocks(x: jax.Array, geo: Blocking, fill: Any = 0) -> jax.Array:
    """[B, Sq, Hq, F] -> [nq, B, Hkv, G, bq, F]."""
    x = pad_axis(x, 1, geo.sq_pad, fill)
    x = x.reshape(geo.b, geo.nq, geo.bq, geo.hkv, geo.group, x.shape[-1])
    return x.transpose(1, 0, 3, 4, 2, 5)


def unblock_q(x: jax.Array, geo: Blocking) -> jax.Array:
    """[nq, B, Hkv, G, bq, F] -> [B, Sq, Hq, F]."""
    x = x.transpose(1, 0, 4, 2, 3, 5).reshape(geo.b, geo.sq_pad, geo.hq, x.shape[-1])
    return x[:, : geo.sq]


def kv_blocks(x: jax.Array, geo: Blocking) -> jax.Array:
    """[B, Sk, Hkv, F] -> [nk, B, Hkv, bk, F]."""
    x = pad_axis(x, 1, geo.sk_pad)
    x = x.reshape(geo.b, geo.nk, geo.bk, geo.hkv, x.shape[-1])
    return x.transpose(1, 0, 3, 2, 4)


def unblock_kv(x: jax.Array, geo: Blocking) -> jax.Array:
    """[nk, B, Hkv, bk, F] -> [B, Sk, Hkv, F]."""
    x = x.transpose(1, 0, 3, 2, 4).reshape(geo.b, geo.sk_pad, geo.hkv, x.shape[-1])
    return x[:, : geo.sk]


def segment_blocks(
    ids: jax.Array | None, geo: Tiling, *, keys: bool, stacked: bool = True
) -> jax.Array | None:
    """[B, Sq] query (or [B, Sk] key) segment ids -> [n, B, block] int32 (``stacked``) or
    [B, n, block]; padded positions carry -1, which hides them. ``None`` stays ``None``."""
    if ids is None:
        return None
    pad, n, block = (geo.sk_pad, geo.nk, geo.bk) if keys else (geo.sq_pad, geo.nq, geo.bq)
    ids = pad_axis(ids.astype(jnp.int32), 1, pad, -1)
    ids = ids.reshape(ids.shape[0], n, block)
    return ids.transpose(1, 0, 2) if stacked else ids


@attrs.frozen(kw_only=True)
class SideInputs:
    """A call's bias, attention mask and segment ids in an op's block layout (each may be
    absent): bias and mask as the op's ``pair(x, geo, fill)`` lays them out, segment ids by
    :func:`segment_blocks`."""

    bias: Any
    mask: Any
    q_segments: jax.Array | None
    kv_segments: jax.Array | None

    @classmethod
    def of(
        cls,
        a: dict[str, Any],
        geo: Tiling,
        pair: Callable[[jax.Array, Any, Any], Any],
        *,
        stacked: bool = True,
        kv_segments: bool = True,
    ) -> SideInputs:
        """``kv_segments=False`` leaves the key segment ids out (they travel elsewhere)."""
        bias, mask, kv_ids = a["bias"], a["attention_mask"], a["kv_segment_ids"]
        return cls(
            bias=None if bias is None else pair(bias, geo, 0),
            mask=None if mask is None else pair(mask, geo, False),
            q_segments=segment_blocks(a["q_segment_ids"], geo, keys=False, stacked=stacked),
            kv_segments=segment_blocks(kv_ids, geo, keys=True, stacked=stacked)
            if kv_segments
            else None,
        )


def as_4d(x: jax.Array) -> jax.Array:
    """Leading axes of size 1 up to 4 dimensions (a bias or mask against [B, Hq, Sq, Sk])."""
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def take(x: jax.Array, i: Any) -> jax.Array:
    """Block ``i`` of a block-stacked array (block 0 of one that has a single block)."""
    if x.shape[0] == 1:
        return x[0]
    if isinstance(i, int):
        return x[i]
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``einsum`` accumulating in float32 (matmul inputs keep their dtype)."""
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------------------------
# Loops
# --------------------------------------------------------------------------------------------


def when(pred: Any, fn: Callable[[Any], Any], carry: Any) -> Any:
    """``fn(carry)`` where ``pred`` holds, else ``carry``; statically resolved when possible."""
    return when_else(pred, fn, lambda c: c, carry)


def when_else(pred: Any, fn: Callable[[Any], Any], other: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` or ``other(x)``; ``pred`` ``None``/``True``/``False`` decides statically."""
    if pred is None or pred is True:
        return fn(x)
    if pred is False:
        return other(x)
    fn, other = _vma.same_branches(fn, other, x)
    return lax.cond(pred, fn, other, x)


def scan(body: Callable[[Any, Any], Any], init: Any, n: int) -> tuple[Any, Any]:
    """``lax.scan`` over ``range(n)``; a single step runs unrolled with a Python index."""
    if n == 1:
        carry, ys = body(init, 0)
        return carry, jax.tree.map(lambda y: y[None], ys)
    init = _vma.scan_init(body, init, jnp.int32(0))
    return lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))


def map_blocks(fn: Callable[[Any], Any], n: int) -> Any:
    """``fn(i)`` for ``i`` in ``range(n)``, stacked (a sequential map: one block live)."""
    _, ys = scan(lambda carry, i: (carry, fn(i)), None, n)
    return ys


# --------------------------------------------------------------------------------------------
# Masking and the online softmax
# --------------------------------------------------------------------------------------------


def block_visibility(
    q_pos: Any,
    k_pos: Any,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    kv_valid: Any = None,
    attention_mask: Any = None,
) -> Any:
    """:func:`ejkernel.attention_semantics.visible` of a tile, ``None`` when nothing hides."""
    if (
        not causal
        and window is None
        and all(t is None for t in (q_segment_ids, kv_valid, attention_mask))
    ):
        return None
    return visible(
        q_pos,
        k_pos,
        causal=causal,
        window=window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        kv_valid=kv_valid,
        attention_mask=attention_mask,
    )


def tile_may_see(tiling: Tiling, st: Any, i: Any, j: Any) -> Any:
    """Whether causality and the window (``st.causal``, ``st.sliding_window``) leave block
    (i, j) of ``tiling`` any visible entry; ``None`` when they hide nothing.

    Depends on block indices only, so it stays a scalar branch condition under ``vmap``.
    """
    if not st.causal and st.sliding_window is None:
        return None
    # Which blocks may see each other depends on the lengths alone, not on batch or heads.
    sem = Geometry(
        batch=1,
        sq=tiling.sq,
        sk=tiling.sk,
        num_q_heads=1,
        num_kv_heads=1,
        causal=st.causal,
        window=st.sliding_window,
    )
    return sem.block_may_see(i, j, tiling.bq, tiling.bk)


def block_scores(
    s: jax.Array,
    *,
    softmax_scale: float,
    logits_soft_cap: float | None,
    bias: jax.Array | None,
    vis: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Masked float32 logits of a tile from ``s = q·kᵀ``, and the soft-capped logits.

    The second result (``None`` without a soft cap) is what
    :func:`ejkernel.attention_semantics.soft_cap_grad` takes in the backward.
    """
    s = s * softmax_scale
    capped = None
    if logits_soft_cap is not None:
        s = capped = soft_cap(s, logits_soft_cap)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if vis is not None:
        s = mask_scores(s, vis)
    return s, capped


def online_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,
    v_j: jax.Array,
    pv_spec: str,
    keep: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block of the online softmax (FlashAttention-2 Alg. 1, Sec. 3.1.1).

    ``carry = (m, denom, acc)``: running row maximum, denominator and accumulator (float32);
    ``s`` the block's masked logits; ``keep`` the dropout keep-mask (applied to the numerator
    only). A row that has seen nothing yet has ``m = MASK_VALUE``; its junk terms are scaled
    by ``exp(MASK_VALUE - m_new) = 0`` once it sees a key, or dropped by :func:`finish_rows`.
    """
    m, denom, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    denom = alpha * denom + jnp.sum(p, axis=-1)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    pv = dot(pv_spec, p.astype(v_j.dtype), v_j)
    return m_new, denom, alpha[..., None] * acc + pv


def initial_rows(rows: tuple[int, ...], dv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(m, denom, acc)`` before any key block: ``MASK_VALUE``, 0, 0."""
    return (
        jnp.full(rows, MASK_VALUE, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros((*rows, dv), jnp.float32),
    )


def finish_rows(
    m: jax.Array,
    denom: jax.Array,
    acc: jax.Array,
    *,
    sinks: jax.Array | None = None,
    dropout_prob: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """``(out, logsumexp)`` of rows after the last key block, both float32.

    Sinks (``[..., n]`` broadcasting against the row statistics) join the maximum and the
    denominator only. A row that saw no key returns zeros and :data:`EMPTY_ROW_LSE`.
    """
    seen = m > MASK_VALUE
    if sinks is not None:
        m_all = jnp.maximum(m, jnp.max(sinks, axis=-1))
        rescale = jnp.exp(m - m_all)
        denom = denom * rescale + jnp.sum(jnp.exp(sinks - m_all[..., None]), axis=-1)
        acc = acc * rescale[..., None]
        m = m_all
    denom = jnp.where(seen, denom, 1.0)
    inv_denom = jnp.where(seen, 1.0 / denom, 0.0)
    if dropout_prob > 0.0:
        inv_denom = inv_denom * (1.0 / (1.0 - dropout_prob))
    out = jnp.where(seen[..., None], acc * inv_denom[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(denom), EMPTY_ROW_LSE)
    return out, lse


@attrs.define
class BackwardRows:
    """What the backward's tiles read per query row (FlashAttention-2 Alg. 2).

    ``delta = rowsum(dO ∘ O)`` (float32, shaped like the logsumexp) is the softmax-Jacobian
    term shared by every key of a row (Sec. 3.1.2); the query, ``dO`` (in the query dtype),
    logsumexp (padding rows :data:`EMPTY_ROW_LSE`) and ``delta`` cut into query blocks.
    """

    delta: jax.Array
    q: jax.Array
    d_out: jax.Array
    lse: jax.Array
    delta_blocks: jax.Array

    @classmethod
    def of(cls, a: dict[str, Any], d_out: jax.Array, geo: Blocking) -> BackwardRows:
        """From the forward's residuals ``a`` (``query``, ``out``, ``logsumexp``) and ``dO``."""
        q = a["query"]
        d_out = d_out.astype(q.dtype)
        delta = jnp.sum(d_out.astype(jnp.float32) * a["out"].astype(jnp.float32), axis=-1)
        return cls(
            delta=delta,
            q=q_blocks(q, geo),
            d_out=q_blocks(d_out, geo),
            lse=q_blocks(a["logsumexp"][..., None], geo, fill=EMPTY_ROW_LSE)[..., 0],
            delta_blocks=q_blocks(delta[..., None], geo)[..., 0],
        )


def block_gradients(
    rows: BackwardRows,
    i: Any,
    k_j: jax.Array,
    v_j: jax.Array,
    scores: tuple[jax.Array, jax.Array | None],
    *,
    keep: jax.Array | None,
    st: Any,
    reduce_bias: Callable[[jax.Array], Any],
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """The gradients of the tile (query block ``i``, key block ``k_j``/``v_j``)
    (FlashAttention-2 Alg. 2, lines 11-20): ``(dq_i, dk_j, dv_j, db)`` before the softmax
    scale.

    ``scores`` is :func:`block_scores`' ``(masked logits, soft-capped logits)``; ``keep`` the
    tile's dropout keep-mask (``None`` without dropout); ``st`` carries ``dropout_prob`` and
    ``logits_soft_cap``; ``reduce_bias`` turns ``dS`` into the op's bias-gradient part (taken
    before the soft cap's derivative, as the bias is added after the cap).
    """
    q_i, do_i = take(rows.q, i), take(rows.d_out, i)
    s, capped = scores
    p = jnp.exp(s - take(rows.lse, i)[..., None])
    p_dropped = p
    if keep is not None:
        scale_dropped = 1.0 / (1.0 - st.dropout_prob)
        p_dropped = jnp.where(keep, p * scale_dropped, 0.0)
    dv = dot("bhgqk,bhgqd->bhkd", p_dropped.astype(do_i.dtype), do_i)
    dp = dot("bhgqd,bhkd->bhgqk", do_i, v_j)
    if keep is not None:
        dp = jnp.where(keep, dp * scale_dropped, 0.0)
    ds = p * (dp - take(rows.delta_blocks, i)[..., None])
    db = reduce_bias(ds)
    if capped is not None:
        ds = ds * soft_cap_grad(capped, st.logits_soft_cap)
    ds = ds.astype(q_i.dtype)
    dq_i = dot("bhgqk,bhkd->bhgqd", ds, k_j)
    dk = dot("bhgqk,bhgqd->bhkd", ds, q_i)
    return dq_i, dk, dv, db
