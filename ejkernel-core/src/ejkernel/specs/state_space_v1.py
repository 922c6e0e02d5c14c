"""state_space_v1: the Mamba-1 selective scan (a diagonal SSM with input-dependent step).

Semantics every implementation follows (OPS.md vocabulary; ``I`` channels, ``N`` state size),
as Mamba's ``selective_scan`` (Gu and Dao, "Mamba: Linear-Time Sequence Modeling with
Selective State Spaces", 2023, Alg. 2 with the zero-order-hold of A and the Euler step of B):

- ``Δ = dt + dt_bias`` (``dt_bias`` ``[I]`` when given), then ``softplus(Δ)`` when
  ``dt_softplus``;
- per channel i and state n: ``h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) B_t``, i.e.
  ``h_t[i, n] = exp(Δ_t[i] A[i, n]) h_{t-1}[i, n] + Δ_t[i] x_t[i] B_t[n]``;
- ``y_t[i] = Σ_n C_t[n] h_t[i, n] + D[i] x_t[i]``, then ``y_t *= silu(gate_t)`` when a
  ``gate`` (Mamba's ``z``) is given.

``A`` is usually negative (``-exp(A_log)``) and ``Δ`` positive, so ``exp(Δ A) ≤ 1``. An
entry ``A = -inf`` keeps no memory: its decay is 0 wherever ``Δ > 0`` (with zero gradients,
not ``0 · inf``) and 1 where ``Δ = 0`` (no time passes); see :func:`decay_rate`. The state
starts from ``initial_state`` ``[B, I, N]`` (zeros when not given); ``return_state=True``
returns ``(out, final_state)`` with the state in float32. A NaN or inf at token t reaches only
the outputs of token t and the tokens after it. ``out`` keeps the dtype of ``x``; accumulation
is float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import (
    CHUNKED_TOLERANCES,
    builtin_op_spec,
    call_op,
    check_array,
    check_flag,
    check_floating,
    letter_shape,
    synthetic_normals,
)

__all__ = [
    "LETTERS",
    "SPEC",
    "check_state_space_arrays",
    "decay_rate",
    "gated_output",
    "state_space_v1",
    "state_space_v1_reference",
    "validate_state_space_v1",
]

OP = "state_space_v1"

#: Every array argument's shape in OPS.md letters.
LETTERS = {
    "x": "[B, S, I]",
    "A": "[I, N]",
    "B": "[B, S, N]",
    "C": "[B, S, N]",
    "D": "[I]",
    "dt": "[B, S, I]",
    "gate": "[B, S, I]",
    "dt_bias": "[I]",
    "initial_state": "[B, I, N]",
}


def state_space_v1_reference(
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
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The selective scan token by token (a ``lax.scan`` over time) in float32: the oracle."""
    f32 = lambda v: v.astype(jnp.float32)
    b, _, i = x.shape
    n = A.shape[1]
    delta = f32(dt) if dt_bias is None else f32(dt) + f32(dt_bias)
    if dt_softplus:
        delta = jax.nn.softplus(delta)
    h0 = jnp.zeros((b, i, n), jnp.float32) if initial_state is None else f32(initial_state)
    a = decay_rate(A)

    def step(h: jax.Array, xs: Any) -> tuple[jax.Array, jax.Array]:
        x_t, d_t, b_t, c_t = xs  # [B, I], [B, I], [B, N], [B, N]
        h = jnp.exp(d_t[..., None] * a) * h + (d_t * x_t)[..., None] * b_t[:, None, :]
        return h, jnp.einsum("bin,bn->bi", h, c_t)

    time_major = lambda v: jnp.moveaxis(f32(v), 1, 0)
    final, y = jax.lax.scan(step, h0, tuple(map(time_major, (x, delta, B, C))))
    y = jnp.moveaxis(y, 0, 1) + f32(D) * f32(x)
    return gated_output(y, gate, x.dtype, final if return_state else None)


#: Stands in for ``A = -inf`` in ``Δ A``: ``exp(Δ · -1e30)`` is 0 for any ``Δ > 1e-28`` and
#: 1 for ``Δ = 0``, and the product's gradients stay finite.
_NO_MEMORY = -1e30


def decay_rate(A: jax.Array) -> jax.Array:
    """``A`` in float32 as the references multiply it by ``Δ``: ``-inf`` entries (a state that
    keeps no memory) replaced by -1e30, so ``exp(Δ A)`` is 0 for ``Δ > 0`` and 1 for ``Δ = 0``
    (not ``exp(0 · -inf)`` = NaN) and every gradient through it is finite."""
    return jnp.maximum(A.astype(jnp.float32), _NO_MEMORY)


def gated_output(y: jax.Array, gate: Any, dtype: Any, final: Any) -> Any:
    """A state-space op's output from its float32 ``y``: ``y ⊙ silu(gate)`` (when gated) in
    ``dtype``, paired with the final state when one is given."""
    if gate is not None:
        y = y * jax.nn.silu(gate.astype(jnp.float32))
    out = y.astype(dtype)
    return out if final is None else (out, final)


def validate_state_space_v1(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of the selective scan. Raises ValueError/TypeError."""
    op = OP
    x, A = a["x"], a["A"]
    check_array(op, "x", x, ndim=3, letters=LETTERS["x"])
    check_array(op, "A", A, ndim=2, letters=LETTERS["A"])
    b, s, i = x.shape
    if min(s, i) == 0:
        raise ValueError(f"{op}: `x` must have non-empty S and I; got x.shape={tuple(x.shape)}")
    if A.shape[0] != i or A.shape[1] == 0:
        raise ValueError(
            f"{op}: `A` must be [I, N] with I={i}, N >= 1; got A.shape={tuple(A.shape)}"
        )
    sizes = {"B": b, "S": s, "I": i, "N": A.shape[1]}
    return check_state_space_arrays(op, a, LETTERS, sizes, checked=("x", "A"))


def check_state_space_arrays(
    op: str,
    a: dict[str, Any],
    letters: dict[str, str],
    sizes: dict[str, int],
    *,
    checked: tuple[str, ...],
) -> dict[str, Any]:
    """The checks every state-space op shares: each array of ``letters`` (name -> shape in
    OPS.md letters) that is given is floating and, unless its shape is already ``checked``,
    has the shape those letters spell with ``sizes``; ``dt_softplus``/``return_state`` are
    bools."""
    for name, spelled in letters.items():
        v = a.get(name)
        if v is None:
            continue
        if name not in checked:
            want = letter_shape(spelled, sizes)
            check_array(op, name, v, ndim=len(want), letters=spelled)
            if tuple(v.shape) != want:
                raise ValueError(
                    f"{op}: `{name}` must be {spelled}={want}; got {name}.shape={tuple(v.shape)}"
                )
        check_floating(op, ((name, v),))
    for flag in ("dt_softplus", "return_state"):
        a[flag] = check_flag(op, flag, a.get(flag))
    return a


def synthetic_state_space(abstract: Any, seed: int = 0) -> dict[str, Any]:
    """Valid inputs for autotuning a state-space op: ``A < 0``, positive steps ``dt``."""
    small_steps = lambda x: 0.1 * np.logaddexp(0.0, x)  # small positive steps
    adjust = {"A": lambda x: -np.exp(0.5 * x), "dt": small_steps, "dt_bias": small_steps}
    return synthetic_normals(abstract, seed, adjust)


def state_space_v1(
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
    return_state: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Mamba-1 selective scan: ``h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t``, ``y_t = C_t h_t + D x_t``.

    Args:
        x: [B, S, I] input.
        A: [I, N] state matrix (diagonal per channel; negative for decay).
        B: [B, S, N] input projection per token.
        C: [B, S, N] output projection per token.
        D: [I] skip connection.
        dt: [B, S, I] step sizes Δ (before ``dt_bias`` and ``dt_softplus``).
        gate: [B, S, I]; the output is multiplied by ``silu(gate)`` (Mamba's z).
        dt_bias: [I] added to ``dt``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        initial_state: [B, I, N]; zeros when ``None``.
        return_state: also return the final state.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        out [B, S, I] in the dtype of ``x``; with ``return_state``, ``(out, final_state)`` and
        final_state [B, I, N] float32.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    state_space_v1,
    differentiable=("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state"),
    synthetic=synthetic_state_space,
    tolerances=CHUNKED_TOLERANCES,
)
