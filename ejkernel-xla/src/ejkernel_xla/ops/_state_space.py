"""What the XLA state-space ops (``state_space_v1``, ``state_space_v2``) share: their array
arguments, chunk lengths fitted to a call, ``Δ`` from ``dt``, and the skip connection and gate
around the scan's output."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel_xla.ops._chunk_numerics import floor_gate
from ejkernel_xla.ops._tuning import fit_chunk

__all__ = [
    "ARRAYS",
    "arrays",
    "delta",
    "fitted",
    "log_decay",
    "pull_skip_and_gate",
    "skip_and_gate",
]

#: The ops' array arguments (the passes read them by name; ``None`` when absent).
ARRAYS = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")


def arrays(args: dict[str, Any]) -> dict[str, Any]:
    """The array arguments of a call's keywords, every name of :data:`ARRAYS` present."""
    return {n: args.get(n) for n in ARRAYS}


def fitted(inv: Any, chunk: int) -> int:
    """``chunk``, or the smallest power of two covering a shorter sequence (``x``'s axis 1)."""
    return fit_chunk(chunk, int(inv.kwargs["x"].shape[1]))


def delta(dt: jax.Array, dt_bias: jax.Array | None, softplus: bool) -> jax.Array:
    """``Δ = dt + dt_bias`` (bias per channel or head), then ``softplus(Δ)``; float32."""
    out = dt.astype(jnp.float32)
    if dt_bias is not None:
        out = out + dt_bias.astype(jnp.float32)
    return jax.nn.softplus(out) if softplus else out


#: Stands in for ``A = -inf`` inside ``Δ A``, so that the product is a number: 0 for ``Δ = 0``,
#: below the gate floor for any ``Δ > 1e-28``.
_A_FLOOR = 1e30


def log_decay(delta: jax.Array, a: jax.Array) -> jax.Array:
    """The log decay ``Δ A`` (float32), floored (:func:`floor_gate`): ``A = -inf`` is a state
    reset for ``Δ > 0`` while ``Δ = 0`` (padding) still passes the state through, and the
    gradients stay finite (0 wherever the floor holds, as the recurrence's ``exp(Δ A) · …``)."""
    return floor_gate(delta * jnp.maximum(a.astype(jnp.float32), -_A_FLOOR))


def skip_and_gate(y: jax.Array, x: jax.Array, skip: jax.Array, gate: jax.Array | None) -> jax.Array:
    """``(y + D x) ⊙ silu(gate)`` in float32; ``D`` is per channel ``[I]`` or per head ``[H]``
    (broadcast over the head's channels)."""
    d = skip.astype(jnp.float32).reshape(skip.shape + (1,) * (x.ndim - 2 - skip.ndim))
    out = y + d * x.astype(jnp.float32)
    if gate is not None:
        out = out * jax.nn.silu(gate.astype(jnp.float32))
    return out


def pull_skip_and_gate(
    a: dict[str, Any], y: jax.Array, d_out: jax.Array
) -> tuple[dict[str, jax.Array], jax.Array]:
    """The cotangents of :func:`skip_and_gate` from ``d_out``: ``({x, D, gate}, d_y)`` (float32;
    ``gate`` only when given)."""
    outer = {n: a[n] for n in ("x", "D", "gate") if a[n] is not None}
    _, pull = jax.vjp(lambda o, y: skip_and_gate(y, o["x"], o["D"], o.get("gate")), outer, y)
    return pull(d_out.astype(jnp.float32))
