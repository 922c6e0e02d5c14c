"""state_space_v2: Mamba-2 (SSD), a state-space layer with one scalar decay per head.

Semantics every implementation follows (OPS.md vocabulary; ``H`` heads of ``P`` channels,
``G`` groups of ``B``/``C`` shared by ``H / G`` consecutive heads, ``N`` state size), as Mamba-2's
``mamba_chunk_scan_combined`` (Dao and Gu, "Transformers are SSMs: Generalized Models and
Efficient Algorithms Through Structured State Space Duality", ICML 2024, Sec. 6):

- ``Δ = dt + dt_bias`` (``dt_bias`` ``[H]`` when given), then ``softplus(Δ)`` when
  ``dt_softplus``;
- head h reads group ``g = h // (H / G)`` of ``B`` and ``C``; per head:
  ``h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t ⊗ B_t`` (state ``[P, N]``),
  ``y_t = h_t C_t + D_h x_t``, then ``y_t *= silu(gate_t)`` when a ``gate`` (Mamba's z,
  ``[B, S, H, P]``) is given.

``A_h = -inf`` makes head h keep no memory: its decay is 0 wherever ``Δ > 0`` (a state
reset at every token, with zero gradients) and 1 where ``Δ = 0``, as in ``state_space_v1``.
``chunk_size`` is a tuning hint for chunked implementations (it wins over their config); the
result does not depend on it. ``A`` is usually negative (``-exp(A_log)``). The state starts
from ``initial_state`` ``[B, H, P, N]`` (zeros when not given); ``return_state=True`` returns
``(out, final_state)`` with the state in float32. A NaN or inf at token t reaches only the
outputs of token t and the tokens after it. ``out`` keeps the dtype of ``x``; accumulation is
float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import CHUNKED_TOLERANCES, builtin_op_spec, call_op, check_array
from ejkernel.specs.state_space_v1 import (
    check_state_space_arrays,
    decay_rate,
    gated_output,
    synthetic_state_space,
)

__all__ = [
    "LETTERS",
    "SPEC",
    "state_space_v2",
    "state_space_v2_reference",
    "validate_state_space_v2",
]

OP = "state_space_v2"

#: Every array argument's shape in OPS.md letters.
LETTERS = {
    "x": "[B, S, H, P]",
    "A": "[H]",
    "B": "[B, S, G, N]",
    "C": "[B, S, G, N]",
    "D": "[H]",
    "dt": "[B, S, H]",
    "gate": "[B, S, H, P]",
    "dt_bias": "[H]",
    "initial_state": "[B, H, P, N]",
}


def state_space_v2_reference(
    x: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    dt: jax.Array,
    *,
    gate: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    initial_state: jax.Array | None = None,
    chunk_size: int | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The SSD recurrence token by token (a ``lax.scan`` over time) in float32: the oracle."""
    del chunk_size  # a tuning hint; the math does not depend on it
    f32 = lambda v: v.astype(jnp.float32)
    b, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    delta = f32(dt) if dt_bias is None else f32(dt) + f32(dt_bias)
    if dt_softplus:
        delta = jax.nn.softplus(delta)
    per_head = lambda v: jnp.repeat(f32(v), h // g, axis=2)  # [B, S, G, N] -> [B, S, H, N]
    h0 = jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None else f32(initial_state)
    a = decay_rate(A)  # A = -inf: no memory (decay 0 for Δ > 0), finite gradients

    def step(state: jax.Array, xs: Any) -> tuple[jax.Array, jax.Array]:
        x_t, d_t, b_t, c_t = xs  # [B, H, P], [B, H], [B, H, N], [B, H, N]
        decay = jnp.exp(d_t * a)[..., None, None]
        state = decay * state + (d_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        return state, jnp.einsum("bhpn,bhn->bhp", state, c_t)

    time_major = lambda v: jnp.moveaxis(v, 1, 0)
    xs = (time_major(f32(x)), time_major(delta), time_major(per_head(B)), time_major(per_head(C)))
    final, y = jax.lax.scan(step, h0, xs)
    y = jnp.moveaxis(y, 0, 1) + f32(D)[:, None] * f32(x)
    return gated_output(y, gate, x.dtype, final if return_state else None)


def validate_state_space_v2(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of SSD. Raises ValueError/TypeError."""
    op = OP
    x, B = a["x"], a["B"]
    check_array(op, "x", x, ndim=4, letters=LETTERS["x"])
    check_array(op, "B", B, ndim=4, letters=LETTERS["B"])
    b, s, h, p = x.shape
    if min(s, h, p) == 0:
        raise ValueError(f"{op}: `x` must have non-empty S, H, P; got x.shape={tuple(x.shape)}")
    g, n = B.shape[2], B.shape[3]
    if tuple(B.shape[:2]) != (b, s) or g == 0 or h % g != 0 or n == 0:
        raise ValueError(
            f"{op}: `B` must be [B, S, G, N] with H % G == 0; got B.shape={tuple(B.shape)}, "
            f"x.shape={tuple(x.shape)}"
        )
    sizes = {"B": b, "S": s, "H": h, "P": p, "G": g, "N": n}
    check_state_space_arrays(op, a, LETTERS, sizes, checked=("x", "B"))
    chunk = a.get("chunk_size")
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"{op}: `chunk_size` must be a positive int or None; got {chunk!r}")
        a["chunk_size"] = int(chunk)
    return a


def state_space_v2(
    x: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    dt: jax.Array,
    *,
    gate: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    initial_state: jax.Array | None = None,
    chunk_size: int | None = None,
    return_state: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Mamba-2 SSD: ``h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t ⊗ B_t``, ``y_t = h_t C_t + D_h x_t``.

    Args:
        x: [B, S, H, P] input.
        A: [H] scalar state decay per head (negative for decay).
        B: [B, S, G, N] input projection; head h uses group h // (H / G).
        C: [B, S, G, N] output projection.
        D: [H] skip connection.
        dt: [B, S, H] step sizes Δ (before ``dt_bias`` and ``dt_softplus``).
        gate: [B, S, H, P]; the output is multiplied by ``silu(gate)`` (Mamba's z).
        dt_bias: [H] added to ``dt``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        initial_state: [B, H, P, N]; zeros when ``None``.
        chunk_size: chunk length of chunked implementations (wins over their config).
        return_state: also return the final state.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        out [B, S, H, P] in the dtype of ``x``; with ``return_state``, ``(out, final_state)`` and
        final_state [B, H, P, N] float32.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    state_space_v2,
    differentiable=("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state"),
    synthetic=synthetic_state_space,
    tolerances=CHUNKED_TOLERANCES,
)
