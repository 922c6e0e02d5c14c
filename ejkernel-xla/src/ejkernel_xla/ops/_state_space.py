"""What the XLA state-space ops (``state_space_v1``, ``state_space_v2``) share: ``Δ`` from
``dt``, the skip connection and gate around the scan's output, and chunk lengths."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "backend",
    "check_chunk_size",
    "delta",
    "fit_chunk",
    "pull_skip_and_gate",
    "skip_and_gate",
]


def backend(table: Mapping[str, Any]) -> str:
    """This process's JAX backend as a key of ``table`` (``"gpu"`` for CUDA/ROCm; ``"cpu"``
    when ``table`` does not know it)."""
    name = jax.default_backend().lower()
    name = "gpu" if name in ("cuda", "rocm") else name
    return name if name in table else "cpu"


def fit_chunk(chunk: int, length: int) -> int:
    """``chunk``, or the smallest power of two covering a shorter sequence."""
    if length >= chunk:
        return chunk
    return 1 << max(0, (length - 1).bit_length())


def check_chunk_size(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of a config's ``chunk_size``: an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}: `{attribute.name}` must be an int >= 1; got {value!r}"
        )


def delta(dt: jax.Array, dt_bias: jax.Array | None, softplus: bool) -> jax.Array:
    """``Δ = dt + dt_bias`` (bias per channel or head), then ``softplus(Δ)``; float32."""
    out = dt.astype(jnp.float32)
    if dt_bias is not None:
        out = out + dt_bias.astype(jnp.float32)
    return jax.nn.softplus(out) if softplus else out


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
