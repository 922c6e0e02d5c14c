"""ring_attention: sequence-parallel flash attention inside ``jax.shard_map``.

Semantics every implementation follows (OPS.md vocabulary; see also
:mod:`ejkernel.specs.flash_attention`, whose masking arguments this op shares):

- Without ``axis_name`` the op *is* ``flash_attention`` on the arrays it is given.
- With ``axis_name`` the call runs inside ``jax.shard_map`` over a mesh holding that axis, of
  size ``n``, and every device holds shard ``r = axis_index(axis_name)`` of the sequence:
  ``query`` is rows ``[r·Sq, (r+1)·Sq)`` of a global ``[B, n·Sq, Hq, D]`` query and
  ``key``/``value`` are rows ``[r·Sk, (r+1)·Sk)`` of the global keys and values, so local query
  i sits at global row ``r·Sq + i``. The result is the device's rows of ``flash_attention`` on
  the global arrays: causality and the sliding window use global positions, bottom-right
  aligned for the global lengths (query row ``g`` at position ``n·Sk - n·Sq + g``).
- Sharded along the ring like the sequence: ``q_segment_ids`` ``[B, Sq]`` (local rows) and
  ``kv_segment_ids`` ``[B, Sk]`` (local rows). ``bias`` and ``attention_mask`` hold the
  device's query rows and *every* key column: broadcastable to ``[B, Hq, Sq, n·Sk]`` (a query
  axis of 1 is shared by every row; a key axis of 1 by every column).
- Dropout hashes ``(dropout_seed, batch, head, global query row, global key row)``, so it drops
  the entries the unsharded call drops when batch and heads are not split over other mesh axes
  (their indices are the device-local ones).
- ``layout`` says which global rows a device holds. ``"contiguous"``: device r holds rows
  ``[r·S, (r+1)·S)`` as above. ``"zigzag"`` (load-balanced causal work): the global sequence is
  cut into ``2n`` chunks of ``S/2`` rows and device r holds chunks ``r`` and ``2n - 1 - r``, in
  that order; :func:`zigzag_layout` puts a global array into that order (shard it contiguously
  afterwards) and :func:`undo_zigzag_layout` restores the order. Under causal masking every
  device then does the same work at every ring step. It needs ``Sq == Sk`` (even) locally and
  takes no ``bias`` or ``attention_mask`` (their key columns would follow another order).
- Replicated differentiable inputs (``softmax_aux``, a ``bias`` the same on every device) get
  the gradient summed over the ring, as ``shard_map`` expects.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from ejkernel.specs._base import (
    broadcastable,
    builtin_op_spec,
    call_op,
    check_array,
    is_floating,
)
from ejkernel.specs.flash_attention import (
    flash_attention_reference,
    validate_flash_attention,
)

__all__ = [
    "LAYOUTS",
    "SPEC",
    "ring_attention",
    "ring_attention_reference",
    "undo_zigzag_layout",
    "validate_ring_attention",
    "zigzag_layout",
]

OP = "ring_attention"
#: The sequence layouts of the ring (``layout=``).
LAYOUTS = ("contiguous", "zigzag")


def _zigzag_order(n: int) -> list[int]:
    """Chunk order of the zigzag layout: device r's two chunks, r and 2n - 1 - r, in turn."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def _reorder(x: jax.Array, order: list[int], axis: int) -> jax.Array:
    size = x.shape[axis]
    if size % len(order):
        raise ValueError(
            f"{OP}: the zigzag layout cuts axis {axis} into {len(order)} chunks (2·n); "
            f"got length {size}"
        )
    chunks = jax.numpy.split(x, len(order), axis=axis)
    return jax.numpy.concatenate([chunks[c] for c in order], axis=axis)


def zigzag_layout(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """Reorder a global sequence axis into ring attention's zigzag layout over ``n`` devices.

    The axis is cut into ``2n`` equal chunks and device r's pair ``(r, 2n - 1 - r)`` is laid
    out in turn, so sharding the result contiguously over the ring gives each device its pair.
    Apply it to query, key, value and the segment ids alike.

    Args:
        x: an array whose ``axis`` (the sequence; 1 for ``[B, S, ...]``) has a length divisible
            by ``2n``.
        n: the ring size.
        axis: the sequence axis.

    Returns:
        ``x`` with its chunks reordered; :func:`undo_zigzag_layout` is the inverse.
    """
    return _reorder(x, _zigzag_order(n), axis)


def undo_zigzag_layout(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """The inverse of :func:`zigzag_layout`: the sequence back in its natural order."""
    order = _zigzag_order(n)
    inverse = [order.index(c) for c in range(2 * n)]
    return _reorder(x, inverse, axis)


def ring_axis_size(axis_name: Any) -> int | None:
    """Size of the bound mesh axis ``axis_name``; ``None`` outside a ``shard_map`` binding it."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return None


def ring_attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: Any = None,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    layout: str = "contiguous",
    **options: Any,
) -> jax.Array:
    """The oracle: gather the global arrays, run the flash attention reference, keep my rows.

    ``options`` are the other keyword arguments of :func:`ring_attention` (sinks, scale,
    causal, window, soft cap, dropout): they need no gathering. In the zigzag layout the
    gathered sequences are put back in their natural order first, and the result into the
    layout again."""
    if axis_name is None:
        return flash_attention_reference(
            query,
            key,
            value,
            bias=bias,
            attention_mask=attention_mask,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            **options,
        )

    n = ring_axis_size(axis_name) or 1
    zigzag = layout == "zigzag"

    def gather(x: jax.Array, axis: int) -> jax.Array:
        x = lax.all_gather(x, axis_name, axis=axis, tiled=True)
        return undo_zigzag_layout(x, n, axis) if zigzag and axis == 1 else x

    def gather_ids(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else gather(x, 1)

    def gather_rows(x: jax.Array | None) -> jax.Array | None:
        """Bias/mask rows: gathered when they vary along the query axis, else shared."""
        if x is None:
            return None
        x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
        return gather(x, 2) if x.shape[2] > 1 else x

    out = flash_attention_reference(
        gather(query, 1),
        gather(key, 1),
        gather(value, 1),
        bias=gather_rows(bias),
        attention_mask=gather_rows(attention_mask),
        q_segment_ids=gather_ids(q_segment_ids),
        kv_segment_ids=gather_ids(kv_segment_ids),
        **options,
    )
    if zigzag:
        out = zigzag_layout(out, n)
    sq = query.shape[1]
    return lax.dynamic_slice_in_dim(out, lax.axis_index(axis_name) * sq, sq, axis=1)


def validate_ring_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument (shapes are the device's shards); fill defaults."""
    axis = a.get("axis_name")
    ring = 1
    if axis is not None:
        try:
            hash(axis)
        except TypeError as err:
            raise TypeError(
                f"{OP}: `axis_name` must be a mesh axis name (hashable); got {axis!r}"
            ) from err
        size = ring_axis_size(axis)
        if size is None:
            raise ValueError(
                f"{OP}: `axis_name`={axis!r} is not a bound mesh axis; call ring_attention "
                f"inside jax.shard_map over a mesh with that axis (or pass axis_name=None)"
            )
        ring = size
    layout = a.get("layout", "contiguous")
    if layout not in LAYOUTS:
        raise ValueError(f"{OP}: `layout` must be one of {LAYOUTS}; got {layout!r}")
    dense = {name: a.pop(name, None) for name in ("bias", "attention_mask")}
    a = validate_flash_attention(a, op=OP)
    b, sq, hq, _ = a["query"].shape
    if layout == "zigzag":
        sk = a["key"].shape[1]
        if sq != sk or sq % 2:
            raise ValueError(
                f"{OP}: `layout`='zigzag' needs query and key shards of one even length "
                f"(Sq == Sk, two chunks each); got query.shape={tuple(a['query'].shape)}, "
                f"key.shape={tuple(a['key'].shape)}"
            )
        given = [name for name, x in dense.items() if x is not None]
        if given:
            raise ValueError(
                f"{OP}: `layout`='zigzag' takes no `{given[0]}` (its key columns would follow "
                f"the contiguous order); use layout='contiguous'"
            )
        # Its steps are flash attention on a pair of chunks: a window would need global
        # positions, sinks would be counted once per step, dropout its global mask.
        for name, unset in (("sliding_window", None), ("softmax_aux", None), ("dropout_prob", 0.0)):
            if a.get(name) not in (unset, None):
                raise ValueError(
                    f"{OP}: `layout`='zigzag' takes no `{name}`; use layout='contiguous'"
                )
    target = (b, hq, sq, ring * a["key"].shape[1])
    letters = "[B, Hq, Sq, n·Sk] (n the ring size, Sk the local key rows)"
    for name, x in dense.items():
        if x is None:
            continue
        check_array(OP, name, x, ndim=(1, 2, 3, 4), letters=f"broadcastable to {letters}")
        if name == "attention_mask" and x.dtype != jax.numpy.bool_:
            raise TypeError(
                f"{OP}: `attention_mask` must be bool (True = may attend); got {x.dtype}"
            )
        if name == "bias" and not is_floating(x):
            raise TypeError(f"{OP}: `bias` must be floating; got dtype {x.dtype}")
        if not broadcastable(tuple(x.shape), target):
            raise ValueError(
                f"{OP}: `{name}` must be broadcastable to {letters}={target}; got "
                f"{name}.shape={tuple(x.shape)}"
            )
    a.update(dense)
    return a


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: Any = None,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | jax.Array | None = None,
    layout: str = "contiguous",
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Sequence-parallel flash attention: K/V shards rotate around ``axis_name``.

    Call it inside ``jax.shard_map`` with the sequence axis of query, key and value split over
    ``axis_name``; each device returns its own query rows of the global attention. Without
    ``axis_name`` it is :func:`ejkernel.flash_attention`.

    Args:
        query: [B, Sq, Hq, D], the device's query rows (global row ``r·Sq + i``).
        key: [B, Sk, Hkv, D], the device's key rows, Hq % Hkv == 0 (GQA/MQA).
        value: [B, Sk, Hkv, Dv].
        axis_name: the mesh axis the sequence is split over (static); ``None``: no ring.
        bias: added to the logits, broadcastable to [B, Hq, Sq, n·Sk] (my query rows, every
            key column); differentiable.
        attention_mask: bool, broadcastable to [B, Hq, Sq, n·Sk], True = may attend.
        q_segment_ids: [B, Sq] int (my rows); with ``kv_segment_ids`` [B, Sk] (my key rows):
            equal ids attend, negative ids are padding.
        softmax_aux: [Hq] or [Hq, n_sinks] attention-sink logits (denominator only).
        softmax_scale: multiplies the logits; default D ** -0.5.
        causal: causal mask on global positions, bottom-right aligned for the global lengths.
        sliding_window: ``(left, right)`` or ``w``, on global positions; intersected with
            ``causal``.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before bias and masking.
        dropout_prob: dropout on attention probabilities.
        dropout_seed: int or integer scalar array; default 0. Entries are dropped by a hash of
            (seed, batch, head, global query row, global key row).
        layout: which global rows each device holds: ``"contiguous"`` (device r: rows
            ``[r·S, (r+1)·S)``) or ``"zigzag"`` (chunks r and 2n-1-r of 2n; see
            :func:`zigzag_layout`), which balances causal work across the ring.
        platform: force an installed platform.
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype (my rows); rows with no visible key are zeros.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    ring_attention, differentiable=("query", "key", "value", "bias", "softmax_aux")
)
