"""Ring attention whose per-device step is the selected flash-attention kernel.

The ring of Ring Attention (Liu, Zaharia and Abbeel, 2023, Sec. 3) with each step one call of
the flash-attention implementation the usual selection picks for the step's shapes, among
those offering the (out, lse) contract (:func:`ejkernel.plugins.flash_attention_lse_step`):

- Forward. At step t device r holds the key/value shard of device ``s = (r - t) mod n``
  (with its ``kv_segment_ids``). The next rotation (``lax.ppermute`` r -> r + 1) is issued
  before the step's compute, which does not depend on it, so the transfer overlaps the kernel.
  Each step returns ``(out_s, lse_s)``; they merge exactly as partial softmaxes:
  ``lse = logaddexp(lse, lse_s)``, ``out = out·exp(lse_old - lse) + out_s·exp(lse_s - lse)``.
- Backward. Each step's gradients come from the step's backward given the *merged* output and
  log-sum-exp (``P = exp(S - lse)`` is the global softmax restricted to the shard); dQ stays,
  dK/dV travel with their shard and a last hop brings them home.
- Which part of a shard pair a step computes depends only on ``(r, s)`` and the layout, and is
  one of a few static kinds chosen with ``lax.switch``. Contiguous layout, causal: the diagonal
  pair is a causal call, an earlier shard a full call, a later shard nothing. Zigzag layout
  (device r holds chunks r and 2n-1-r), causal: the diagonal pair is a causal call; an earlier
  shard (s < r) is seen by both query chunks through its first chunk only (all queries × the
  first half of the keys); a later shard (s > r) only by the second query chunk (the second half
  of the queries × all keys). Every off-diagonal step is then half a pair's work on every
  device: causal work is even across the ring. Each branch returns full-size float32 arrays
  (its rows placed, the rest empty) and the merge happens outside the switch: branches that take
  the accumulator and update their rows in place make XLA's GPU compiler crash (jaxlib 0.11.2,
  two GPUs; benchmarks/RESULTS.md).

What this path serves: segment ids, GQA, soft cap and scale; causal needs ``Sq == Sk``
locally. Masks that need global positions inside a step (sliding window), bias, attention mask,
dropout and sinks go to the blockwise ring of :mod:`ejkernel_xla.ops.ring_attention` (contiguous
layout only).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import EMPTY_ROW_LSE
from ejkernel.plugins import flash_attention_lse_step
from ejkernel_xla.ops._ring import vary_like

__all__ = ["backward", "forward", "serves"]

#: Step kinds, the ``lax.switch`` branch indices.
_FULL, _DIAGONAL, _SKIP, _KEYS_FIRST_HALF, _QUERIES_SECOND_HALF = range(5)


def serves(a: dict[str, Any]) -> bool:
    """Whether this path computes the call (else the blockwise ring does)."""
    if any(a.get(n) is not None for n in ("bias", "attention_mask", "softmax_aux")):
        return False
    if a.get("dropout_prob") or a.get("sliding_window") is not None:
        return False
    return not a.get("causal") or a["query"].shape[1] == a["key"].shape[1]


def _kind(a: dict[str, Any], rank: Any, src: Any) -> Any:
    """The step kind of the pair (my queries, shard ``src``)."""
    if not a.get("causal"):
        return jnp.int32(_FULL)
    if a.get("layout") == "zigzag":
        earlier, later = _KEYS_FIRST_HALF, _QUERIES_SECOND_HALF
    else:
        earlier, later = _FULL, _SKIP
    return jnp.where(src == rank, _DIAGONAL, jnp.where(src < rank, earlier, later)).astype(
        jnp.int32
    )


def _parts(kind: int, s: int) -> tuple[slice, slice]:
    """Query rows and key rows a step kind computes."""
    half = s // 2
    if kind == _KEYS_FIRST_HALF:
        return slice(0, s), slice(0, half)
    if kind == _QUERIES_SECOND_HALF:
        return slice(half, s), slice(0, s)
    return slice(0, s), slice(0, s)


def _step_args(
    a: dict[str, Any], q: Any, q_seg: Any, shard: dict[str, Any], kind: int
) -> dict[str, Any]:
    """The flash-attention arguments of one step kind (query rows and key rows sliced)."""
    rows, cols = _parts(kind, q.shape[1])
    args = {
        "query": q[:, rows],
        "key": shard["key"][:, cols],
        "value": shard["value"][:, cols],
        "softmax_scale": a["softmax_scale"],
        "logits_soft_cap": a.get("logits_soft_cap"),
        "causal": kind == _DIAGONAL,
    }
    if q_seg is not None:
        args["q_segment_ids"] = q_seg[:, rows]
        args["kv_segment_ids"] = shard["segments"][:, cols]
    return args


def _rotate(tree: Any, n: int, axis: Any) -> Any:
    """Send every array of ``tree`` from device r to device r + 1 of the ring."""
    perm = [(r, (r + 1) % n) for r in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis, perm), tree)


def _place(part: jax.Array, full_shape: tuple[int, ...], where: slice, fill: float) -> jax.Array:
    """``part`` at rows ``where`` of axis 1 of a ``full_shape`` array filled with ``fill``."""
    if part.shape[1] == full_shape[1]:
        return part
    full = jnp.full(full_shape, fill, part.dtype)
    return lax.dynamic_update_slice_in_dim(full, part, where.start, axis=1)


def _merge_lse(lse: jax.Array) -> jax.Array:
    """A step's lse for merging: an empty row (``EMPTY_ROW_LSE`` or +inf) weighs nothing."""
    return jnp.where(lse >= EMPTY_ROW_LSE, -jnp.inf, lse.astype(jnp.float32))


def _kinds(a: dict[str, Any]) -> tuple[int, ...]:
    if not a.get("causal"):
        return (_FULL,)
    if a.get("layout") == "zigzag":
        return (_FULL, _DIAGONAL, _SKIP, _KEYS_FIRST_HALF, _QUERIES_SECOND_HALF)
    return (_FULL, _DIAGONAL, _SKIP)


def forward(a: dict[str, Any], axis: Any) -> tuple[jax.Array, dict[str, Any]]:
    """``(out [B, Sq, Hq, Dv], residuals)``; the residuals hold the merged lse."""
    q, q_seg = a["query"], a.get("q_segment_ids")
    b, s, hq, _ = q.shape
    dv = a["value"].shape[3]
    n, rank = int(lax.axis_size(axis)), lax.axis_index(axis)
    shard = {"key": a["key"], "value": a["value"], "segments": a.get("kv_segment_ids")}

    def branch(kind: int) -> Any:
        def run(shard: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
            if kind == _SKIP:
                out = jnp.zeros((b, s, hq, dv), jnp.float32)
                lse = jnp.full((b, s, hq), -jnp.inf, jnp.float32)
                return vary_like((out, lse), q, axis)
            args = _step_args(a, q, q_seg, shard, kind)
            out, lse = flash_attention_lse_step(**args).forward(**args)
            rows, _ = _parts(kind, s)
            out = _place(out.astype(jnp.float32), (b, s, hq, dv), rows, 0.0)
            lse = _place(_merge_lse(lse), (b, s, hq), rows, -jnp.inf)
            return vary_like((out, lse), q, axis)

        return run

    kinds = _kinds(a)
    branches = [branch(k) for k in kinds]

    def visit(acc: Any, shard: dict[str, Any], t: Any) -> Any:
        src = (rank - t) % n
        index = jnp.searchsorted(jnp.asarray(kinds), _kind(a, rank, src))
        out_s, lse_s = lax.switch(index, branches, shard) if len(kinds) > 1 else branches[0](shard)
        out, lse = acc
        new = jnp.logaddexp(lse, lse_s)
        safe = jnp.where(jnp.isneginf(new), 0.0, new)
        out = out * jnp.exp(lse - safe)[..., None] + out_s * jnp.exp(lse_s - safe)[..., None]
        return out, new

    init = vary_like(
        (jnp.zeros((b, s, hq, dv), jnp.float32), jnp.full((b, s, hq), -jnp.inf, jnp.float32)),
        q,
        axis,
    )

    def step(carry: Any, t: Any) -> tuple[Any, None]:
        acc, shard = carry
        nxt = _rotate(shard, n, axis)  # issued before the compute it overlaps
        return (visit(acc, shard, t), nxt), None

    acc = init
    if n > 1:
        (acc, shard), _ = lax.scan(step, (acc, shard), jnp.arange(n - 1))
    out, lse = visit(acc, shard, n - 1)
    out = out.astype(q.dtype)
    lse = jnp.where(jnp.isneginf(lse), EMPTY_ROW_LSE, lse)
    residuals = {n_: a.get(n_) for n_ in ("query", "key", "value")}
    residuals.update(
        q_segment_ids=q_seg, kv_segment_ids=a.get("kv_segment_ids"), out=out, logsumexp=lse
    )
    return out, residuals


def backward(
    res: dict[str, Any], d_out: jax.Array, a: dict[str, Any], axis: Any
) -> dict[str, jax.Array | None]:
    """Gradients of query, key and value from the merged statistics of :func:`forward`.

    ``a`` holds the call's static arguments (scale, soft cap, causal, layout).
    """
    q, k, v, out, lse = (res[n] for n in ("query", "key", "value", "out", "logsumexp"))
    q_seg = res["q_segment_ids"]
    s = q.shape[1]
    n, rank = int(lax.axis_size(axis)), lax.axis_index(axis)
    d_out = d_out.astype(q.dtype)
    a = {**a, "query": q, "key": k}
    zero = functools.partial(jnp.zeros, dtype=jnp.float32)

    def branch(kind: int) -> Any:
        def run(shard: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
            if kind == _SKIP:
                return vary_like((zero(q.shape), zero(k.shape), zero(v.shape)), q, axis)
            args = _step_args(a, q, q_seg, shard, kind)
            rows, cols = _parts(kind, s)
            grads = flash_attention_lse_step(**args).backward(
                out[:, rows], lse[:, rows], d_out[:, rows], **args
            )
            dq = _place(grads["query"].astype(jnp.float32), q.shape, rows, 0.0)
            dk = _place(grads["key"].astype(jnp.float32), k.shape, cols, 0.0)
            dv = _place(grads["value"].astype(jnp.float32), v.shape, cols, 0.0)
            return vary_like((dq, dk, dv), q, axis)

        return run

    kinds = _kinds(a)
    branches = [branch(kind) for kind in kinds]

    def visit(dq: Any, shard: dict[str, Any], t: Any) -> tuple[Any, dict[str, Any]]:
        src = (rank - t) % n
        index = jnp.searchsorted(jnp.asarray(kinds), _kind(a, rank, src))
        step = {n_: shard[n_] for n_ in ("key", "value", "segments")}
        dq_s, dk_s, dv_s = (
            lax.switch(index, branches, step) if len(kinds) > 1 else branches[0](step)
        )
        return dq + dq_s, {**shard, "dk": shard["dk"] + dk_s, "dv": shard["dv"] + dv_s}

    shard = {
        "key": k,
        "value": v,
        "segments": res["kv_segment_ids"],
        "dk": vary_like(zero(k.shape), q, axis),
        "dv": vary_like(zero(v.shape), q, axis),
    }
    dq = vary_like(zero(q.shape), q, axis)

    def step(carry: Any, t: Any) -> tuple[Any, None]:
        dq, shard = carry
        # Keys and values go out before the compute; their gradients once it has added to them.
        ahead = _rotate({n_: shard[n_] for n_ in ("key", "value", "segments")}, n, axis)
        dq, shard = visit(dq, shard, t)
        moved = _rotate({"dk": shard["dk"], "dv": shard["dv"]}, n, axis)
        return (dq, {**ahead, **moved}), None

    if n > 1:
        (dq, shard), _ = lax.scan(step, (dq, shard), jnp.arange(n - 1))
    dq, shard = visit(dq, shard, n - 1)
    dk, dv = (shard["dk"], shard["dv"]) if n == 1 else _rotate((shard["dk"], shard["dv"]), n, axis)
    return {
        "query": dq.astype(q.dtype),
        "key": dk.astype(k.dtype),
        "value": dv.astype(v.dtype),
        "bias": None,
        "softmax_aux": None,
    }
