"""blocksparse_attention on XLA: online-softmax attention over load-balanced live key blocks.

Pure JAX, O(S) memory, with a hand-written backward attached through
:func:`ejkernel.plugins.defvjp`. The work grows with the number of live blocks, whatever their
distribution over rows, and no static bound on the live count is needed: ``block_mask`` may be
traced, the schedule below is built inside the graph.

- Rows. Every (batch, query head, query block) is a *row*, ``R = B · Hq · nq`` of them. Inputs
  keep their ``[B, S, H, D]`` layout (reshaped to ``[B, n, b, H, D]``; blocks are gathered
  straight from it); query head h reads key/value head ``h // (Hq // Hkv)``, so GQA never
  repeats K or V. Sequences are padded to block multiples
  (``nq = ceil(Sq / bq)``, ``nk = ceil(Sk / bk)``): padded keys are masked, padded query rows
  dropped.
- Live blocks. ``block_mask`` broadcast to ``[B, Hq, nq, nk]``, minus the blocks causality or
  the sliding window hide entirely. A stable ``argsort`` moves each row's live key-block
  indices to the front (``order [R, nk]``, ``count [R]``).
- Schedule (load balancing). ``L = 2R`` *lanes* run in parallel for ``T`` steps, where ``T``
  is the least step count with ``Σ_r ceil(count_r / T) ≤ L``; row r's live blocks are cut into
  ``ceil(count_r / T)`` consecutive pieces of at most ``T`` blocks, one lane each. The work,
  ``L · T`` block products, is at most ``2 · live + 2R`` (if ``T - 1`` steps did not fit,
  ``live > (T - 1) · R``), so a row with many live blocks borrows lanes from sparse rows instead
  of setting the trip count for everyone; with equal counts per row it is exactly the live
  blocks. ``T`` is traced: the loop is a ``lax.while_loop`` (``fori_loop`` with a traced bound).
- Forward (FlashAttention-2's online softmax, Dao 2023, Sec. 3.1.1). Each step gathers every
  lane's next key/value block (``[L, bk, D]``), forms the ``[L, bq, bk]`` logits with one
  batched matmul, masks them per element (causal, window, key padding, ``attention_mask``,
  segment ids, and the lane's end) and updates the lane's running maximum, denominator and
  accumulator. Lanes of one row are then merged with segment max/sum:
  ``m = max m_l``, ``denom = Σ denom_l e^(m_l - m)``, ``acc = Σ acc_l e^(m_l - m)``.
- Backward (Alg. 2) on the same schedule, recomputing ``P = exp(S - logsumexp)`` with the
  row's saved logsumexp: ``dQ`` accumulates per lane and is summed into rows at the end;
  ``dK``/``dV`` contributions (``dSᵀ Q``, ``Pᵀ dO``) and a bias gradient are scatter-added at
  each lane's block index (duplicates add up).
- Dead blocks are never read: a lane past the end of its piece (or a spare lane) still takes
  a step, but its gathered key/value block is zeros and its logits are masked, so a dead
  block's contents (NaN in an unwritten cache, say) cannot reach the result.
- A row with no visible key keeps the finite mask value as its maximum and returns zeros with
  zero gradients (its saved logsumexp makes every recomputed probability 0).

Accumulation is float32; matmul inputs keep the input dtype. No config: the block sizes are
the mask's. It declines nothing (no ``supports``): this backend serves every valid call.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import (
    MASK_VALUE,
    bias_grad,
    finite_or_zero,
    soft_cap_grad,
)
from ejkernel.plugins import defvjp
from ejkernel.specs.blocksparse_attention import SPEC
from ejkernel_xla.ops._adapter import Blocked, Passes
from ejkernel_xla.ops._blockwise import (
    Blocking,
    SideInputs,
    block_scores,
    block_visibility,
    finish_rows,
    initial_rows,
    online_step,
    pad_axis,
)

__all__ = ["blocksparse_attention_xla"]

#: Lanes per row of the schedule: work ≤ (LANES_PER_ROW / (LANES_PER_ROW - 1)) · live + lanes.
LANES_PER_ROW = 2


def blocksparse_attention_xla(*, cfg: None = None, **args: Any) -> jax.Array:
    """Block-sparse attention over live blocks only.

    Args:
        cfg: unused (the block sizes are the mask's).
        **args: :func:`ejkernel.blocksparse_attention`'s arguments by name, as its spec
            validated them (absent ones take their defaults).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return _PASSES.primal(args, cfg)


# --------------------------------------------------------------------------------------------
# Statics, geometry, layouts
# --------------------------------------------------------------------------------------------


def _statics(arrays: dict[str, Any], cfg: None, backward: bool, static: Any) -> Blocked:
    """The mask's blocks ``block_size = (bq, bk)`` in both passes."""
    del cfg, backward
    bq, bk = static["block_size"]
    return Blocked.of(arrays["query"], static, block_q=int(bq), block_k=int(bk))


@attrs.frozen(kw_only=True)
class _Geometry(Blocking):
    """:class:`~ejkernel_xla.ops._blockwise.Blocking` and the rows and lanes of the schedule."""

    @classmethod
    def of_call(cls, a: dict[str, Any], st: Blocked) -> _Geometry:
        return cls.of(a["query"], a["key"], a["value"], st.block_q, st.block_k)

    @property
    def rows(self) -> int:
        return self.b * self.hq * self.nq

    @property
    def lanes(self) -> int:
        return LANES_PER_ROW * self.rows


def _q_blocks(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[B, Sq, Hq, ...] -> [B, nq, bq, Hq, ...] (a reshape: lanes gather from it directly)."""
    x = pad_axis(x, 1, geo.nq * geo.bq)
    return x.reshape(geo.b, geo.nq, geo.bq, *x.shape[2:])


def _unrow_q(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[R, bq, F] -> [B, Sq, Hq, F], row r = (b · Hq + h) · nq + i."""
    x = x.reshape(geo.b, geo.hq, geo.nq, geo.bq, x.shape[-1]).transpose(0, 2, 3, 1, 4)
    return x.reshape(geo.b, geo.nq * geo.bq, geo.hq, x.shape[-1])[:, : geo.sq]


def _kv_blocks(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[B, Sk, Hkv, F] -> [B, nk, bk, Hkv, F] (a reshape: lanes gather from it directly)."""
    x = pad_axis(x, 1, geo.nk * geo.bk)
    return x.reshape(geo.b, geo.nk, geo.bk, geo.hkv, x.shape[-1])


def _unblock_kv(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[B, nk, bk, Hkv, F] -> [B, Sk, Hkv, F]."""
    return x.reshape(geo.b, geo.nk * geo.bk, geo.hkv, x.shape[-1])[:, : geo.sk]


# --------------------------------------------------------------------------------------------
# Live blocks and the lane schedule
# --------------------------------------------------------------------------------------------


def _live_blocks(block_mask: jax.Array, geo: _Geometry, st: Blocked) -> jax.Array:
    """[R, nk]: the block mask, minus blocks that causality or the window hide entirely."""
    live = jnp.broadcast_to(block_mask, (geo.b, geo.hq, geo.nq, geo.nk))
    q_lo = jnp.arange(geo.nq)[:, None] * geo.bq + (geo.sk - geo.sq)
    q_hi = jnp.minimum(q_lo + geo.bq, geo.sk) - 1  # the last query block may be partial
    k_lo = jnp.arange(geo.nk)[None, :] * geo.bk
    k_hi = jnp.minimum(k_lo + geo.bk, geo.sk) - 1
    if st.causal:
        live = live & (k_lo <= q_hi)
    if st.sliding_window is not None:
        left, right = st.sliding_window
        live = live & (k_lo <= q_hi + right) & (k_hi >= q_lo - left)
    return live.reshape(geo.rows, geo.nk)


def _schedule(live: jax.Array, geo: _Geometry) -> dict[str, jax.Array]:
    """Cut each row's live blocks into pieces of at most ``steps`` blocks, one lane each.

    Returns ``order [R, nk]`` (live block indices first), ``steps`` (scalar), and per lane
    ``row``, ``start`` (offset of its piece in the row's live list) and ``count`` (blocks in
    its piece; 0 for a spare lane), each ``[L]`` int32.
    """
    order = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(live, axis=-1, dtype=jnp.int32)  # [R]
    # The least step count t whose pieces fit the lanes: lanes needed, Σ ceil(count / t), only
    # shrink as t grows and t = nk always fits (one piece per row), so bisect [1, nk].
    fits = lambda t: jnp.sum(-(-count // t)) <= geo.lanes
    lo, hi = jnp.int32(1), jnp.int32(geo.nk)
    for _ in range(geo.nk.bit_length()):
        mid = (lo + hi) // 2
        ok = fits(mid)
        lo, hi = jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    steps = hi
    pieces = -(-count // steps)  # [R]
    ends = jnp.cumsum(pieces)
    lane = jnp.arange(geo.lanes, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, lane, side="right"), geo.rows - 1).astype(jnp.int32)
    start = (lane - (ends[row] - pieces[row])) * steps
    lane_count = jnp.where(lane < ends[-1], jnp.clip(count[row] - start, 0, steps), 0)
    return {
        "order": order,
        "steps": jnp.where(ends[-1] > 0, steps, 0),
        "row": row,
        "start": start.astype(jnp.int32),
        "count": lane_count.astype(jnp.int32),
    }


@attrs.frozen(kw_only=True)
class _Lanes:
    """Per-lane indices (each [L] int32) derived from a schedule."""

    row: jax.Array
    b: jax.Array
    h: jax.Array
    kv_head: jax.Array
    i: jax.Array
    start: jax.Array
    count: jax.Array

    @classmethod
    def of(cls, schedule: dict[str, jax.Array], geo: _Geometry) -> _Lanes:
        row = schedule["row"]
        h = (row // geo.nq) % geo.hq
        return cls(
            row=row,
            b=row // (geo.hq * geo.nq),
            h=h,
            kv_head=h // (geo.hq // geo.hkv),
            i=row % geo.nq,
            start=schedule["start"],
            count=schedule["count"],
        )

    def block(self, order: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each lane's key-block index at step ``t`` and whether it is a live block."""
        pos = jnp.minimum(self.start + t, order.shape[1] - 1)
        return order[self.row, pos], t < self.count

    def gather_q(self, x: jax.Array) -> jax.Array:
        """[B, nq, bq, Hq, ...] -> each lane's query block, [L, bq, ...]."""
        return x[self.b, self.i, :, self.h]

    def gather_kv(self, x: jax.Array, j: jax.Array, valid: jax.Array) -> jax.Array:
        """[B, nk, bk, Hkv, F] -> each lane's key block ``j``, [L, bk, F].

        An idle lane (``valid`` False) reads zeros: its index points at a dead block, whose
        contents (NaN in a padded cache, say) must not reach a product, even times 0.
        """
        return jnp.where(valid[:, None, None], x[self.b, j, :, self.kv_head], 0)

    def scatter_add_kv(self, acc: jax.Array, x: jax.Array, j: jax.Array) -> jax.Array:
        """Add ``x [L, bk, F]`` into ``acc [B, nk, bk, Hkv, F]`` at each lane's block ``j``."""
        return acc.at[self.b, j, :, self.kv_head].add(x)


def _merge_rows(
    m: jax.Array, denom: jax.Array, acc: jax.Array, lanes: _Lanes, geo: _Geometry
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Combine lane statistics ([L, bq], [L, bq], [L, bq, F]) of one row (online softmax)."""
    seg = functools.partial(
        jax.ops.segment_max, segment_ids=lanes.row, num_segments=geo.rows, indices_are_sorted=True
    )
    m_row = jnp.maximum(seg(m), MASK_VALUE)  # a row without lanes: the mask value
    alpha = jnp.exp(m - m_row[lanes.row])
    total = functools.partial(
        jax.ops.segment_sum, segment_ids=lanes.row, num_segments=geo.rows, indices_are_sorted=True
    )
    return m_row, total(alpha * denom), total(alpha[..., None] * acc)


@attrs.frozen(kw_only=True)
class _PairInput:
    """A [B|1, Hq|1, Sq|1, Sk|1] side input (bias or mask) laid out for per-lane gathers.

    ``blocks`` is ``[B|1, Hq|1, nq|1, bq|1, nk|1, bk|1]``: axes the input broadcasts over stay
    of size 1, so a broadcast bias is never materialised.
    """

    blocks: jax.Array
    shape: tuple[int, ...]

    @classmethod
    def of(cls, x: jax.Array, geo: _Geometry, fill: Any) -> _PairInput:
        shape = tuple(x.shape)
        x = x.reshape((1,) * (4 - x.ndim) + shape)
        b1, h1, q1, k1 = x.shape
        nq, bq = (geo.nq, geo.bq) if q1 > 1 else (1, 1)
        nk, bk = (geo.nk, geo.bk) if k1 > 1 else (1, 1)
        if q1 > 1:
            x = pad_axis(x, 2, geo.nq * geo.bq, fill)
        if k1 > 1:
            x = pad_axis(x, 3, geo.nk * geo.bk, fill)
        return cls(blocks=x.reshape(b1, h1, nq, bq, nk, bk), shape=shape)

    def _index(self, lanes: _Lanes, j: jax.Array) -> tuple[jax.Array, ...]:
        b1, h1, nq1, _, nk1, _ = self.blocks.shape
        pick = lambda full, ix: ix if full else jnp.zeros_like(ix)
        return (
            pick(b1 > 1, lanes.b),
            pick(h1 > 1, lanes.h),
            pick(nq1 > 1, lanes.i),
            pick(nk1 > 1, j),
        )

    def gather(self, lanes: _Lanes, j: jax.Array) -> jax.Array:
        """Each lane's block, [L, bq|1, bk|1]."""
        b_ix, h_ix, i_ix, j_ix = self._index(lanes, j)
        return self.blocks[b_ix, h_ix, i_ix, :, j_ix, :]

    def zeros(self) -> jax.Array:
        return jnp.zeros(self.blocks.shape, jnp.float32)

    def scatter_add(self, acc: jax.Array, ds: jax.Array, lanes: _Lanes, j: jax.Array) -> jax.Array:
        """Add ``ds [L, bq, bk]``, summed over the axes the input broadcasts along, into ``acc``."""
        _, _, _, bq1, _, bk1 = self.blocks.shape
        ds = bias_grad(ds, (ds.shape[0], bq1, bk1))
        b_ix, h_ix, i_ix, j_ix = self._index(lanes, j)
        return acc.at[b_ix, h_ix, i_ix, :, j_ix, :].add(ds)

    def finish(self, acc: jax.Array, geo: _Geometry, dtype: Any) -> jax.Array:
        """The accumulated blocks back to the input's own shape and dtype."""
        b1, h1, nq1, bq1, nk1, bk1 = acc.shape
        x = acc.reshape(b1, h1, nq1 * bq1, nk1 * bk1)
        q1 = geo.sq if nq1 * bq1 > 1 else 1
        k1 = geo.sk if nk1 * bk1 > 1 else 1
        return x[:, :, :q1, :k1].reshape(self.shape).astype(dtype)


def _scores(
    q_lanes: jax.Array,
    kb: jax.Array,
    j: jax.Array,
    valid: jax.Array,
    lanes: _Lanes,
    side: SideInputs,
    geo: _Geometry,
    st: Blocked,
) -> tuple[jax.Array, jax.Array | None]:
    """Masked logits of each lane's block ``j``, [L, bq, bk] float32, and the capped ones.

    ``valid [L]`` is False for lanes past the end of their piece: their whole block is masked.
    """
    k_j = lanes.gather_kv(kb, j, valid)
    s = jnp.einsum("lqd,lkd->lqk", q_lanes, k_j, preferred_element_type=jnp.float32)
    q_pos = (lanes.i[:, None] * geo.bq + jnp.arange(geo.bq))[:, :, None] + (geo.sk - geo.sq)
    k_pos = (j[:, None] * geo.bk + jnp.arange(geo.bk))[:, None, :]  # [L, 1, bk]
    segments: dict[str, Any] = {}
    if side.q_segments is not None:
        segments = {
            "q_segment_ids": side.q_segments[lanes.b, lanes.i][:, :, None],  # [L, bq, 1]
            "kv_segment_ids": side.kv_segments[lanes.b, j][:, None, :],  # [L, 1, bk]
        }
    vis = block_visibility(
        q_pos,
        k_pos,
        causal=st.causal,
        window=st.sliding_window,
        kv_valid=valid[:, None, None] & (k_pos < geo.sk),
        attention_mask=None if side.mask is None else side.mask.gather(lanes, j),
        **segments,
    )
    return block_scores(
        s,
        softmax_scale=st.softmax_scale,
        logits_soft_cap=st.logits_soft_cap,
        bias=None if side.bias is None else side.bias.gather(lanes, j),
        vis=vis,
    )


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: Blocked) -> tuple[jax.Array, dict[str, Any]]:
    """``out [B, Sq, Hq, Dv]``, and for the backward it, the logsumexp ``[R, bq]`` (float32)
    and the schedule."""
    # Non-finite keys/values read as 0, so a hidden one contributes nothing (0 · NaN).
    q, k, v = a["query"], finite_or_zero(a["key"]), finite_or_zero(a["value"])
    geo = _Geometry.of_call(a, st)
    side = SideInputs.of(a, geo, _PairInput.of, stacked=False)
    schedule = _schedule(_live_blocks(a["block_mask"], geo, st), geo)
    lanes = _Lanes.of(schedule, geo)
    q_lanes = lanes.gather_q(_q_blocks(q, geo))  # [L, bq, D]
    kb, vb = _kv_blocks(k, geo), _kv_blocks(v, geo)
    init = initial_rows((geo.lanes, geo.bq), geo.dv)

    def step(t: jax.Array, carry: Any) -> Any:
        j, valid = lanes.block(schedule["order"], t)
        s, _ = _scores(q_lanes, kb, j, valid, lanes, side, geo, st)
        return online_step(carry, s, lanes.gather_kv(vb, j, valid), "lqk,lkd->lqd")

    m, denom, acc = _merge_rows(*lax.fori_loop(0, schedule["steps"], step, init), lanes, geo)
    out, lse = finish_rows(m, denom, acc)
    out = _unrow_q(out.astype(q.dtype), geo)
    return out, {"out": out, "logsumexp": lse, "schedule": schedule}


@functools.partial(jax.jit, static_argnames="st")
def _backward(a: dict[str, Any], d_out: jax.Array, st: Blocked) -> dict[str, jax.Array | None]:
    """FlashAttention-2 Alg. 2 on the forward's schedule; dK/dV/dBias by scatter-add.

    Returns:
        Gradients for ``query``, ``key``, ``value`` and ``bias`` (in bias's own shape), each in
        its input's dtype; ``None`` for an absent bias.
    """
    q, k, v = a["query"], finite_or_zero(a["key"]), finite_or_zero(a["value"])
    geo = _Geometry.of_call(a, st)
    side = SideInputs.of(a, geo, _PairInput.of, stacked=False)
    schedule = a["schedule"]
    lanes = _Lanes.of(schedule, geo)
    d_out = d_out.astype(q.dtype)
    # D = rowsum(dO ∘ O): the softmax-Jacobian term shared by every key of a row (Sec. 3.1.2).
    delta = jnp.sum(d_out.astype(jnp.float32) * a["out"].astype(jnp.float32), axis=-1)
    q_lanes = lanes.gather_q(_q_blocks(q, geo))
    do_lanes = lanes.gather_q(_q_blocks(d_out, geo))
    delta_lanes = lanes.gather_q(_q_blocks(delta, geo))  # [L, bq]
    lse_lanes = a["logsumexp"][lanes.row]
    kb, vb = _kv_blocks(k, geo), _kv_blocks(v, geo)
    init = (
        jnp.zeros((geo.lanes, geo.bq, geo.d), jnp.float32),
        jnp.zeros(kb.shape, jnp.float32),
        jnp.zeros(vb.shape, jnp.float32),
        None if side.bias is None else side.bias.zeros(),
    )

    def step(t: jax.Array, carry: Any) -> Any:
        dq, dk, dv, db = carry
        j, valid = lanes.block(schedule["order"], t)
        s, capped = _scores(q_lanes, kb, j, valid, lanes, side, geo, st)
        p = jnp.exp(s - lse_lanes[..., None])  # masked entries and empty rows: exactly 0
        v_j = lanes.gather_kv(vb, j, valid)
        dv_j = jnp.einsum(
            "lqk,lqd->lkd", p.astype(q.dtype), do_lanes, preferred_element_type=jnp.float32
        )
        dp = jnp.einsum("lqd,lkd->lqk", do_lanes, v_j, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_lanes[..., None])
        if db is not None:
            db = side.bias.scatter_add(db, ds, lanes, j)  # type: ignore[union-attr]
        if capped is not None:
            ds = ds * soft_cap_grad(capped, st.logits_soft_cap)
        ds = ds.astype(q.dtype)
        k_j = lanes.gather_kv(kb, j, valid)
        dq = dq + jnp.einsum("lqk,lkd->lqd", ds, k_j, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("lqk,lqd->lkd", ds, q_lanes, preferred_element_type=jnp.float32)
        dk = lanes.scatter_add_kv(dk, dk_j, j)
        dv = lanes.scatter_add_kv(dv, dv_j, j)
        return dq, dk, dv, db

    dq, dk, dv, db = lax.fori_loop(0, schedule["steps"], step, init)
    dq = jax.ops.segment_sum(dq, lanes.row, num_segments=geo.rows, indices_are_sorted=True)
    scale = st.softmax_scale
    return {
        "query": (_unrow_q(dq, geo) * scale).astype(q.dtype),
        "key": (_unblock_kv(dk, geo) * scale).astype(k.dtype),
        "value": _unblock_kv(dv, geo).astype(v.dtype),
        "bias": None if db is None else side.bias.finish(db, geo, a["bias"].dtype),  # type: ignore[union-attr]
    }


_PASSES = Passes(spec=SPEC, statics=_statics, forward=_forward, backward=_backward)
defvjp(blocksparse_attention_xla, _PASSES.fwd, _PASSES.bwd)
