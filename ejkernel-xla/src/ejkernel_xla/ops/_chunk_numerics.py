"""How the chunked linear-attention and state-space forms keep the sequential recurrence's
answer for a log gate of -inf and for non-finite inputs.

- A log gate of -inf is a state reset: its decay is ``exp(-inf) = 0``. The chunked forms take
  decays as differences of cumulative log gates, and ``-inf - -inf`` is NaN; a cumulative sum
  taken as a matmul with a triangle of ones even turns one -inf into NaN everywhere
  (``0 · -inf``). So log gates are floored at ``-GATE_FLOOR`` before anything is summed:
  ``exp(-GATE_FLOOR)`` rounds to 0 in float32 (below half its smallest subnormal, e^-103.97),
  so for gates ≤ 0 every decay across a floored token is still exactly 0, while the cumulative
  sums stay finite. They lose some digits: after a floor the running sum inside its chunk is
  at least 110 in magnitude, so each later addition rounds by up to half its ulp (4e-6 below
  128; n floors in one chunk, about n · 3e-6), the relative error of the decays between the
  tokens after it. Below the floor the gradient is 0, as the recurrence's is there
  (``exp(g) · …`` is 0).
- A non-finite value stays in its causal future. A product over the tokens of a chunk with a
  causal (triangular) left factor multiplies every later token's value by an exact 0, and
  ``0 · NaN`` is NaN: one NaN value would reach the outputs before it. So those products take
  the values with non-finite entries zeroed (:func:`finite_part`), and the outputs from the first
  non-finite token on are set to NaN per channel (:func:`poison`), as the recurrence has them
  non-finite (its state carries the NaN or inf into every later token). Products that mix
  tokens by a mask on their result select with ``jnp.where`` before multiplying instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["GATE_FLOOR", "finite_part", "floor_gate", "floor_gates", "poison"]

#: Log gates below ``-GATE_FLOOR`` (-inf included) are taken as ``-GATE_FLOOR``: a decay of
#: exactly 0 in float32 either way.
GATE_FLOOR = 110.0


def floor_gate(g: jax.Array | None) -> jax.Array | None:
    """``max(g, -GATE_FLOOR)`` (NaN stays NaN; ``None`` stays ``None``)."""
    return None if g is None else jnp.maximum(g, -GATE_FLOOR)


def floor_gates(gates: tuple[Any, ...]) -> tuple[Any, ...]:
    """:func:`floor_gate` of each of ``gates``."""
    return tuple(floor_gate(g) for g in gates)


def finite_part(
    v: jax.Array, axis: int = -2, also: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(v with non-finite entries zeroed, first)``: ``first`` is, per channel, the position
    along ``axis`` (the tokens of a chunk) of the first non-finite entry, or the axis length
    when there is none (``axis`` removed from the shape). ``also`` (broadcast to ``v``): where
    False an entry counts as non-finite too (a token whose other inputs are)."""
    ok = jnp.isfinite(v) if also is None else jnp.isfinite(v) & also
    n = v.shape[axis]
    pos = jax.lax.broadcasted_iota(jnp.int32, v.shape, axis % v.ndim)
    first = jnp.min(jnp.where(ok, n, pos), axis=axis)
    return jnp.where(ok, v, 0.0), first


def poison(out: jax.Array, first: jax.Array, axis: int = -2) -> jax.Array:
    """``out`` with NaN at every position along ``axis`` from ``first`` on (per channel)."""
    pos = jax.lax.broadcasted_iota(jnp.int32, out.shape, axis % out.ndim)
    return jnp.where(pos >= jnp.expand_dims(first, axis), jnp.nan, out)
