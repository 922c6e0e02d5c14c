"""mean_pooling: the mean of each sequence's tokens, dense or packed, forward and backward.

Semantics every implementation follows (OPS.md vocabulary):

- ``x [B, S, D]`` without ``cu_seqlens``: ``out[b] = mean(x[b, :, :])``, one row per batch
  entry.
- ``cu_seqlens [N + 1]`` (integer, non-decreasing) packs N sequences along the token axis of
  ``x [T, D]`` (or ``[1, T, D]``, the packed layout of the linear-attention ops): sequence n is
  tokens ``[cu_seqlens[n], cu_seqlens[n + 1])`` and ``out [N, D]`` has one row per sequence.
  Offsets are clipped to ``[0, T]``; tokens outside ``[cu_seqlens[0], cu_seqlens[N])`` belong
  to no sequence and get zero gradient. The offsets' values are not checked (they may be
  traced).
- ``x [T, D]`` without ``cu_seqlens`` is one sequence of T tokens: ``out [1, D]``.
- An empty sequence (no tokens) gives a zero row, never NaN, and passes no gradient.

Accumulation is float32; the output keeps the input dtype. Differentiable in ``x``: each token
of sequence n receives ``d_out[n] / length_n``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import (
    builtin_op_spec,
    call_op,
    check_array,
    check_cu_seqlens,
    check_floating,
    even_offsets,
    normal_draw,
)

__all__ = [
    "SPEC",
    "mean_pooling",
    "mean_pooling_reference",
    "mean_pooling_synthetic",
    "validate_mean_pooling",
]

OP = "mean_pooling"


def mean_pooling_reference(x: jax.Array, *, cu_seqlens: jax.Array | None = None) -> jax.Array:
    """Sum of each sequence's tokens over its length, in float32, from an explicit
    [sequences, tokens] membership matrix (O(N·T·D): the oracle, not a kernel)."""
    x32 = x.astype(jnp.float32)
    if cu_seqlens is None and x.ndim == 3:
        total = jnp.sum(x32, axis=1)
        return (total / max(x.shape[1], 1)).astype(x.dtype)
    tokens = x32.reshape(-1, x.shape[-1])  # [T, D]
    num_tokens = tokens.shape[0]
    if cu_seqlens is None:
        cu_seqlens = jnp.asarray([0, num_tokens])
    offsets = jnp.clip(cu_seqlens.astype(jnp.int32), 0, num_tokens)
    starts, ends = offsets[:-1], offsets[1:]
    position = jnp.arange(num_tokens)
    member = (position[None, :] >= starts[:, None]) & (position[None, :] < ends[:, None])
    sums = jnp.einsum("nt,td->nd", member.astype(jnp.float32), tokens)
    lengths = jnp.sum(member, axis=1)
    out = jnp.where(lengths[:, None] > 0, sums / jnp.maximum(lengths, 1)[:, None], 0.0)
    return out.astype(x.dtype)


def validate_mean_pooling(a: dict[str, Any], *, op: str = OP) -> dict[str, Any]:
    """Check ``x`` and ``cu_seqlens``. Raises ValueError/TypeError."""
    x, cu = a["x"], a.get("cu_seqlens")
    check_array(op, "x", x, ndim=(2, 3), letters="[B, S, D] or [T, D]")
    check_floating(op, (("x", x),))
    if cu is None:
        return a
    check_cu_seqlens(op, cu)
    if x.ndim == 3 and x.shape[0] != 1:
        raise ValueError(
            f"{op}: with `cu_seqlens`, `x` must be packed [T, D] or [1, T, D]; got "
            f"x.shape={tuple(x.shape)}"
        )
    return a


def mean_pooling_synthetic(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Valid autotuning inputs: normal ``x`` and ``cu_seqlens`` spread evenly over the tokens."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = dict(abstract)
    x = abstract["x"]
    out["x"] = jnp.asarray(normal_draw(rng, x.shape, np.float32), x.dtype)
    cu = abstract.get("cu_seqlens")
    if isinstance(cu, jax.ShapeDtypeStruct):
        num_tokens = x.shape[-2]
        offsets = even_offsets(num_tokens, cu.shape[0] - 1)
        out["cu_seqlens"] = jnp.asarray(offsets, cu.dtype)
    return out


def mean_pooling(
    x: jax.Array,
    *,
    cu_seqlens: jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Mean over each sequence's tokens.

    Args:
        x: [B, S, D]; or packed [T, D] / [1, T, D] with ``cu_seqlens`` (a [T, D] without
            ``cu_seqlens`` is one sequence).
        cu_seqlens: [N + 1] integer, non-decreasing offsets of N sequences packed along the
            token axis (clipped to [0, T]; may be traced).
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [B, D] (dense), [N, D] (packed) or [1, D] (one [T, D] sequence), in the dtype of
        ``x``; an empty sequence gives a zero row. Differentiable in ``x``.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(mean_pooling, differentiable=("x",), synthetic=mean_pooling_synthetic)
