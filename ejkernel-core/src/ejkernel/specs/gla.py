"""gla: gated linear attention (Yang et al., 2024), forward and backward, chunked.

Semantics (OPS.md vocabulary): :func:`ejkernel.recurrent` with ``gk = g`` and no other gate,
for each head ``h_t = h_{t-1} ⊙ exp(g_t)[:, None] + k_tᵀ v_t`` and
``o_t = softmax_scale · q_t h_t`` (``g`` is a log-space decay of the state's K axis;
``softmax_scale`` scales the query, default ``K ** -0.5``). ``initial_state``, ``cu_seqlens``
and ``return_state`` are as in :mod:`ejkernel.specs.recurrent` (states reset at packed sequence
boundaries; tokens outside every sequence give zeros; the final state is float32), and so
are its numerics: a gate of ``-inf`` resets the state, a NaN at token t reaches only token t
and the tokens after it.

Accumulation is float32; the output keeps the query dtype. Differentiable in query, key,
value, ``g`` and ``initial_state``.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel.specs._base import CHUNKED_TOLERANCES, builtin_op_spec, call_op
from ejkernel.specs.recurrent import (
    check_gate,
    linear_recurrence_reference,
    linear_synthetic,
    validate_linear_common,
)

__all__ = ["SPEC", "gla", "gla_reference", "validate_gla"]

OP = "gla"


def gla_reference(
    query: jax.Array, key: jax.Array, value: jax.Array, g: jax.Array, **options: Any
) -> Any:
    """``lax.scan`` over time in float32: the oracle every implementation is tested against.

    The linear recurrence with ``g`` as the key gate; ``options`` are the other keyword
    arguments of :func:`gla`."""
    return linear_recurrence_reference(query, key, value, key_gate=g, **options)


def validate_gla(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of :func:`gla`; fill defaults. Raises ValueError/TypeError."""
    a = validate_linear_common(OP, a)
    b, s, h, dk = a["query"].shape
    check_gate(OP, "g", a["g"], (b, s, h, dk), "[B, S, H, K]")
    return a


def gla(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> Any:
    """Gated linear attention on the best installed platform.

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        g: [B, S, H, K] log-space decay of the state's K axis (e.g. ``log_sigmoid(x) / 16``);
            differentiable.
        initial_state: [N, H, K, V] (N = B, or the number of ``cu_seqlens`` sequences);
            differentiable.
        softmax_scale: scales the query; default K ** -0.5.
        cu_seqlens: [N + 1] integer offsets of N sequences packed along S (B == 1).
        return_state: also return the final states.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    gla,
    differentiable=("query", "key", "value", "g", "initial_state"),
    synthetic=linear_synthetic,
    tolerances=CHUNKED_TOLERANCES,
)
