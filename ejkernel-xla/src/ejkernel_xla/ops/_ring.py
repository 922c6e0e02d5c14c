"""The ring of :mod:`ejkernel_xla.ops.ring_attention`: shard geometry, rotation, replication.

What one device of the ``shard_map`` axis needs to run its part of Ring Attention:

- :class:`Statics`, the static arguments of one ring call, and :class:`RingGeometry`, the block
  geometry of the local shard plus the ring size ``n``;
- :func:`ring`, which visits every key/value shard in turn, and :func:`rotate`, one hop of the
  ring (``lax.ppermute`` from device r to r + 1);
- :func:`vary_like` and :func:`sum_if_replicated`, which keep loop state and gradients typed
  as ``shard_map``'s replication tracking (``check_vma``) expects;
- the blocks of one step: :class:`Shard` (what travels), :func:`side_inputs` (what stays),
  :class:`At` (where a block sits), :func:`scores` and :func:`block_keep` on global positions,
  :func:`block_may_see` and :func:`shard_may_see` (the skips), :func:`sinks`, and
  :class:`BiasGradient`, which accumulates the bias gradient shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import Geometry, bias_grad, finite_or_zero
from ejkernel.specs.flash_attention import dropout_keep
from ejkernel_xla.ops._adapter import Blocked
from ejkernel_xla.ops._blockwise import (
    Blocking,
    SideInputs,
    as_4d,
    block_scores,
    block_visibility,
    dot,
    kv_blocks,
    pad_axis,
    segment_blocks,
    take,
)
from ejkernel_xla.ops._vma import varying

__all__ = [
    "At",
    "BiasGradient",
    "RingGeometry",
    "Shard",
    "Statics",
    "block_keep",
    "block_may_see",
    "ring",
    "rotate",
    "scores",
    "shard_may_see",
    "side_inputs",
    "sinks",
    "sum_if_replicated",
    "vary_like",
    "zeros_like_query",
]


@attrs.frozen(kw_only=True)
class Statics(Blocked):
    """Everything static about one ring call (hashable: the ``jax.jit`` static argument): the
    masking and blocks of :class:`~ejkernel_xla.ops._adapter.Blocked` and the ring's axis."""

    axis_name: Any


# --------------------------------------------------------------------------------------------
# Steps around the ring
# --------------------------------------------------------------------------------------------


def ring(
    visit: Callable[[Any, Any, Any], tuple[Any, Any]],
    fixed: Any,
    shard: Any,
    geo: RingGeometry,
    st: Statics,
) -> tuple[Any, Any]:
    """Run ``visit(fixed, shard, t)`` for t = 0 … n-1, rotating ``shard`` between steps.

    The rotation of step t reads only the shard visit t also reads, so XLA may overlap the
    transfer with the compute; the last step rotates nothing (n - 1 hops in all).
    """

    def step(carry: Any, t: Any) -> tuple[Any, None]:
        fixed, shard = visit(*carry, t)
        return (fixed, rotate(shard, geo, st)), None

    if geo.n > 1:
        (fixed, shard), _ = lax.scan(step, (fixed, shard), jnp.arange(geo.n - 1))
    return visit(fixed, shard, geo.n - 1)


def rotate(tree: Any, geo: RingGeometry, st: Statics) -> Any:
    """Send every array of ``tree`` from device r to device r + 1 of the ring."""
    if geo.n == 1:
        return tree
    perm = [(r, (r + 1) % geo.n) for r in range(geo.n)]
    return jax.tree.map(lambda x: lax.ppermute(x, st.axis_name, perm), tree)


# --------------------------------------------------------------------------------------------
# Replication (shard_map's check_vma typing)
# --------------------------------------------------------------------------------------------


def vary_like(tree: Any, ref: jax.Array, axis: Any) -> Any:
    """Type loop state as varying along ``axis`` when ``ref`` is (scan carries must match)."""
    if axis not in varying(ref):
        return tree
    cast = getattr(lax, "pcast", None)

    def vary(x: jax.Array) -> jax.Array:
        if axis in varying(x):
            return x
        if cast is not None:
            return cast(x, axis, to="varying")
        return lax.pvary(x, axis)  # type: ignore[attr-defined]

    return jax.tree.map(vary, tree)


def zeros_like_query(shape: tuple[int, ...], *, q: jax.Array, axis: Any) -> jax.Array:
    return vary_like(jnp.zeros(shape, jnp.float32), q, axis)


def sum_if_replicated(grad: jax.Array, primal: jax.Array, q: jax.Array, axis: Any) -> jax.Array:
    """Sum a per-device partial gradient over the ring when its input is replicated on it.

    Only when replication is tracked (the query varies along the axis): otherwise
    ``shard_map``'s transpose sums the cotangents of unsplit inputs itself.
    """
    if axis in varying(q) and axis not in varying(primal):
        return lax.psum(grad, axis)
    return grad


# --------------------------------------------------------------------------------------------
# Block helpers
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RingGeometry(Blocking):
    """Flash attention's geometry of one call (local shard lengths) plus the ring size ``n``."""

    n: int

    @classmethod
    def of(cls, a: dict[str, Any], st: Statics) -> RingGeometry:
        q, k, v = a["query"], a["key"], a["value"]
        b, sq, hq, d = q.shape
        return cls(
            n=int(lax.axis_size(st.axis_name)),
            b=b,
            sq=sq,
            sk=k.shape[1],
            hq=hq,
            hkv=k.shape[2],
            d=d,
            dv=v.shape[3],
            bq=st.block_q,
            bk=st.block_k,
        )

    @property
    def offset(self) -> int:
        """Position of global query row 0: bottom-right alignment of the global lengths."""
        return self.n * (self.sk - self.sq)


@attrs.frozen(kw_only=True)
class At:
    """Where a block sits: my rank, the source device of the shard held, block indices."""

    rank: Any
    src: Any
    i: Any
    j: Any


@attrs.frozen(kw_only=True)
class Shard:
    """What travels around the ring: a key/value shard, its segment ids, its dK/dV."""

    key: jax.Array  # [nk, B, Hkv, bk, D]
    value: jax.Array  # [nk, B, Hkv, bk, Dv]
    segments: jax.Array | None  # [nk, B, bk]
    dk: jax.Array | None = None
    dv: jax.Array | None = None

    @classmethod
    def of(cls, a: dict[str, Any], geo: RingGeometry) -> Shard:
        # Non-finite keys/values read as 0, so a hidden one contributes nothing (0 · NaN).
        return cls(
            key=kv_blocks(finite_or_zero(a["key"]), geo),
            value=kv_blocks(finite_or_zero(a["value"]), geo),
            segments=segment_blocks(a["kv_segment_ids"], geo, keys=True),
        )


jax.tree_util.register_pytree_node(
    Shard,
    lambda s: ((s.key, s.value, s.segments, s.dk, s.dv), None),
    lambda _, xs: Shard(key=xs[0], value=xs[1], segments=xs[2], dk=xs[3], dv=xs[4]),
)


def side_inputs(a: dict[str, Any], geo: RingGeometry) -> SideInputs:
    """What stays on the device: the bias and attention mask of my rows over every key column
    ([n|1, nq|1, nk|1, B|1, Hkv|1, G|1, bq|1, bk|1]), my query segment ids."""
    return SideInputs.of(a, geo, _pair_blocks, kv_segments=False)


def _pair_blocks(x: jax.Array, geo: RingGeometry, fill: Any) -> jax.Array:
    """Broadcastable to [B, Hq, Sq, n·Sk] -> [n|1, nq|1, nk|1, B|1, Hkv|1, G|1, bq|1, bk|1].

    The key axis splits into the ring's shards, each padded to whole blocks; axes the array
    broadcasts over stay of size 1 (a broadcast bias is never materialised).
    """
    x = as_4d(x)
    b1, h1, q1, k1 = x.shape
    nq, bq = (geo.nq, geo.bq) if q1 > 1 else (1, 1)
    n, nk, bk = (geo.n, geo.nk, geo.bk) if k1 > 1 else (1, 1, 1)
    hkv, group = (geo.hkv, geo.group) if h1 > 1 else (1, 1)
    if q1 > 1:
        x = pad_axis(x, 2, geo.sq_pad, fill)
    x = x.reshape(b1, h1, nq * bq, n, k1 // n)
    if k1 > 1:
        x = pad_axis(x, 4, geo.sk_pad, fill)
    x = x.reshape(b1, hkv, group, nq, bq, n, nk, bk)
    return x.transpose(5, 3, 6, 0, 1, 2, 4, 7)


def _take_pair(x: jax.Array, at: At) -> jax.Array:
    """Block (i, j) of shard ``at.src`` of a :func:`_pair_blocks` array."""
    return take(take(take(x, at.src), at.i), at.j)


def _rows(geo: RingGeometry, at: At) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Global query rows [bq], global key rows [bk] and in-shard key rows [bk] of a block."""
    q_rows = at.rank * geo.sq + at.i * geo.bq + jnp.arange(geo.bq)
    local_k = at.j * geo.bk + jnp.arange(geo.bk)
    return q_rows, at.src * geo.sk + local_k, local_k


def scores(
    q_i: jax.Array,
    k_j: jax.Array,
    shard: Shard,
    side: SideInputs,
    geo: RingGeometry,
    st: Statics,
    at: At,
) -> tuple[jax.Array, jax.Array | None]:
    """Masked logits of a block, [B, Hkv, G, bq, bk] float32, and the soft-capped ones."""
    q_rows, k_rows, local_k = _rows(geo, at)
    segments: dict[str, Any] = {}
    kv_valid = None
    if side.q_segments is not None:
        # [B, 1, 1, bq, 1] against [B, 1, 1, 1, bk]; padded keys carry id -1: hidden here too.
        segments = {
            "q_segment_ids": take(side.q_segments, at.i)[:, None, None, :, None],
            "kv_segment_ids": take(shard.segments, at.j)[:, None, None, None, :],
        }
    elif geo.sk_pad != geo.sk:
        kv_valid = local_k[None, :] < geo.sk
    vis = block_visibility(
        (q_rows + geo.offset)[:, None],
        k_rows[None, :],
        causal=st.causal,
        window=st.sliding_window,
        kv_valid=kv_valid,
        attention_mask=None if side.mask is None else _take_pair(side.mask, at),
        **segments,
    )
    return block_scores(
        dot("bhgqd,bhkd->bhgqk", q_i, k_j),
        softmax_scale=st.softmax_scale,
        logits_soft_cap=st.logits_soft_cap,
        bias=None if side.bias is None else _take_pair(side.bias, at),
        vis=vis,
    )


def _global(geo: RingGeometry, st: Statics) -> Geometry:
    """The unsharded call's geometry: global lengths ``n·Sq`` and ``n·Sk``."""
    return Geometry(
        batch=geo.b,
        sq=geo.n * geo.sq,
        sk=geo.n * geo.sk,
        num_q_heads=geo.hq,
        num_kv_heads=geo.hkv,
        causal=st.causal,
        window=st.sliding_window,
    )


def block_may_see(geo: RingGeometry, st: Statics, at: At) -> Any:
    """Whether block (i, j) of shard ``at.src`` may hold a visible pair (``None``: yes).

    A query block of device ``rank`` is block ``rank·Sq/bq + i`` of the global rows only
    when ``bq`` divides ``Sq``, so the test runs on positions: query rows
    ``[rank·Sq + i·bq, +bq)`` against key rows ``[src·Sk + j·bk, +bk)``.
    """
    return _rows_may_see(
        geo, st, at.rank * geo.sq + at.i * geo.bq, geo.bq, at.src * geo.sk + at.j * geo.bk, geo.bk
    )


def shard_may_see(geo: RingGeometry, st: Statics, rank: Any, src: Any) -> Any:
    return _rows_may_see(geo, st, rank * geo.sq, geo.sq, src * geo.sk, geo.sk)


def _rows_may_see(geo: RingGeometry, st: Statics, q0: Any, nq: int, k0: Any, nk: int) -> Any:
    """Whether global query rows ``[q0, q0+nq)`` may see keys ``[k0, k0+nk)`` (``None``: yes)."""
    sem = _global(geo, st)
    return sem.span_may_see(q0, nq, k0, nk) if sem.restricted else None


def block_keep(seed: jax.Array, geo: RingGeometry, st: Statics, at: At) -> jax.Array:
    """Dropout keep-mask of a block, [B, Hkv, G, bq, bk], from global rows."""
    q_rows, k_rows, _ = _rows(geo, at)
    return dropout_keep(
        seed,
        jnp.arange(geo.b).reshape(geo.b, 1, 1, 1, 1),
        jnp.arange(geo.hq).reshape(1, geo.hkv, geo.group, 1, 1),
        q_rows[:, None],
        k_rows[None, :],
        st.dropout_prob,
    )


def sinks(aux: jax.Array | None, geo: RingGeometry) -> jax.Array | None:
    """[Hq] or [Hq, n_sinks] -> [1, 1, Hkv, G, 1, n_sinks] against stacked row statistics."""
    if aux is None:
        return None
    return aux.astype(jnp.float32).reshape(1, 1, geo.hkv, geo.group, 1, -1)


@attrs.frozen(kw_only=True)
class BiasGradient:
    """Accumulates ``dS`` into the bias's broadcast shape, shard by shard of its key axis.

    The accumulator has the blocked layout of :func:`_pair_blocks`
    ``[n|1, nq|1, nk|1, B|1, Hkv|1, G|1, bq|1, bk|1]`` in float32; the bias lives on the
    device, so it never travels.
    """

    dims: tuple[int, int, int, int] | None
    shape: tuple[int, ...] | None
    dtype: Any
    geo: RingGeometry

    @classmethod
    def of(cls, bias: jax.Array | None, geo: RingGeometry) -> BiasGradient:
        if bias is None:
            return cls(dims=None, shape=None, dtype=None, geo=geo)
        dims = as_4d(bias).shape
        return cls(dims=dims, shape=tuple(bias.shape), dtype=bias.dtype, geo=geo)  # type: ignore[arg-type]

    def _block_shape(self) -> tuple[int, ...]:
        assert self.dims is not None
        b1, h1, q1, k1 = self.dims
        hkv, group = (self.geo.hkv, self.geo.group) if h1 > 1 else (1, 1)
        return (b1, hkv, group, self.geo.bq if q1 > 1 else 1, self.geo.bk if k1 > 1 else 1)

    def reduce(self, ds: jax.Array) -> jax.Array | None:
        """Sum ``ds`` [B, Hkv, G, bq, bk] over the axes the bias broadcasts along."""
        if self.dims is None:
            return None
        return bias_grad(ds, self._block_shape())

    def zero_block(self, zero: Callable[[tuple[int, ...]], jax.Array]) -> jax.Array | None:
        return None if self.dims is None else zero(self._block_shape())

    def zeros(self, zero: Callable[[tuple[int, ...]], jax.Array]) -> jax.Array | None:
        if self.dims is None:
            return None
        _, _, q1, k1 = self.dims
        n, nk = (self.geo.n, self.geo.nk) if k1 > 1 else (1, 1)
        nq = self.geo.nq if q1 > 1 else 1
        return zero((n, nq, nk, *self._block_shape()))

    def add(self, acc: Any, parts: Any, src: Any) -> Any:
        """Add one shard's block gradients ``[nk, nq, ...]`` to the columns of shard ``src``."""
        if self.dims is None:
            return None
        _, _, q1, k1 = self.dims
        if q1 == 1:
            parts = jnp.sum(parts, axis=1, keepdims=True)
        if k1 == 1:
            return acc + jnp.sum(parts, axis=0, keepdims=True).transpose(1, 0, 2, 3, 4, 5, 6)[None]
        parts = parts.transpose(1, 0, 2, 3, 4, 5, 6)  # [nq|1, nk, ...]
        return acc.at[src].add(parts)

    def finish(self, acc: jax.Array) -> jax.Array:
        """The accumulator in the bias's own shape and dtype."""
        assert self.dims is not None and self.shape is not None
        b1, h1, q1, k1 = self.dims
        n, nq, nk = acc.shape[:3]
        bq, bk = acc.shape[-2:]
        grad = acc.transpose(3, 4, 5, 1, 6, 0, 2, 7).reshape(b1, h1, nq * bq, n, nk * bk)
        grad = grad[:, :, :q1, :, : (self.geo.sk if k1 > 1 else 1)]
        return grad.reshape(self.shape).astype(self.dtype)
