"""state_space_v1 in Triton: the Mamba-1 selective scan as chunked linear attention on the
gla kernels.

Per channel i the state ``h[i, :] [N]`` follows ``h_t = exp(Δ_t[i] A[i]) ⊙ h_{t-1} + Δ_t[i]
x_t[i] B_t`` and ``y_t[i] = C_t · h_t[i]``: gla's recurrence with one head per channel, key
``B_t`` and query ``C_t`` (shared by every channel), a one-wide value ``Δ_t x_t[i]``, the
vector log gate ``Δ_t[i] A[i, :]`` over the N key channels and scale 1. So this module maps the
call onto :mod:`ejkernel_triton.ops.gla` (forward and backward kernels; the shared pieces:
:mod:`ejkernel_triton.ops.state_space_gla`): ``Δ`` (bias, softplus), ``Δ x`` and ``Δ A``
(floored: ``A = -inf`` is a reset where ``Δ > 0``, ``Δ = 0`` passes the state) in JAX before
the kernels; ``y + D x`` and ``silu(gate)`` after them; gradients through gla's backward and
JAX autodiff of that mapping.

Memory: gla's kernels read per-head keys and gates, so ``B``, ``C`` (in ``x``'s dtype) and the
log gate (float32) are laid out ``[B, S, I, N]``, and the value is one wide (the kernels pad
their value tiles to 16). Mamba's own kernel keeps ``Δ A`` and the channel broadcast in
registers; a selective-scan kernel would remove these copies.

Config: :class:`StateSpaceV1Config` (gla's tunables, K = N, V = 1). :func:`supports` declines
an ``x`` dtype other than bf16/f16/f32 and N over 256.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_triton.ops import state_space_gla as ssm
from ejkernel_triton.ops.gla_config import GlaConfig

__all__ = [
    "StateSpaceV1Config",
    "config_space",
    "heuristic",
    "state_space_v1_triton",
    "supports",
]


@attrs.frozen(kw_only=True)
class StateSpaceV1Config(GlaConfig):
    """Tunables of the Triton selective scan: those of the gla kernels it runs on (chunk
    size, blocks over ``N`` (gla's K) and the one-wide value, warps, stages)."""


def _shapes(a: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    b, s, i = a["x"].shape
    return (b, s, i, a["A"].shape[-1]), (b, s, i, 1)


def _as_linear(a: dict[str, Any], softplus: bool) -> dict[str, Any]:
    """gla's arrays: query ``C`` and key ``B`` per channel [B, S, I, N] and value ``Δ x``
    [B, S, I, 1] in ``x``'s dtype, the log gate ``Δ A`` [B, S, I, N] and the initial state
    [B, I, N, 1], float32."""
    x = a["x"]
    dtype = x.dtype
    shape = (*x.shape, a["A"].shape[-1])
    per_channel = lambda v: jnp.broadcast_to(v.astype(dtype)[:, :, None, :], shape)
    d = ssm.delta(a, softplus)
    init = a["initial_state"]
    return {
        "query": per_channel(a["C"]),
        "key": per_channel(a["B"]),
        "value": (d * x.astype(jnp.float32)).astype(dtype)[..., None],
        "g": ssm.log_decay(d[..., None], a["A"]),
        "initial_state": None if init is None else init.astype(jnp.float32)[..., None],
        "cu_seqlens": None,
    }


def _finish(y: jax.Array, a: dict[str, Any]) -> jax.Array:
    """``(y + D x) ⊙ silu(gate)`` in float32 (``D`` per channel)."""
    x = a["x"].astype(jnp.float32)
    return ssm.silu_gate(y[..., 0].astype(jnp.float32) + a["D"].astype(jnp.float32) * x, a["gate"])


MAPPING = ssm.Mapping(
    shapes=_shapes,
    as_linear=_as_linear,
    finish=_finish,
    state=lambda h: h[..., 0],
    state_back=lambda h: h[..., None],
)


def supports(inv: Any) -> bool | str:
    """True, or why not: an ``x`` dtype other than bf16/f16/f32, N over 256."""
    return ssm.supports(inv, MAPPING)


def heuristic(inv: Any) -> StateSpaceV1Config:
    """gla's heuristic at the equivalent shape (K = N, V = 1)."""
    return ssm.heuristic(inv, MAPPING, StateSpaceV1Config)


def config_space(inv: Any) -> list[StateSpaceV1Config]:
    """The heuristic, then gla's config space at the equivalent shape."""
    return ssm.config_space(inv, MAPPING, StateSpaceV1Config)


def state_space_v1_triton(*, cfg: StateSpaceV1Config | None = None, **args: Any) -> Any:
    """The Mamba-1 selective scan through the Triton gla kernels.

    Args:
        **args: the arguments of :func:`ejkernel.specs.state_space_v1.state_space_v1`, by
            name, as the core spec validated them.
        cfg: the gla kernels' tunables; ``None`` takes the heuristic's.

    Returns:
        out [B, S, I] in the dtype of ``x``, or ``(out, final_state [B, I, N] float32)`` when
        ``return_state``.
    """
    return ssm.primal(MAPPING, StateSpaceV1Config, cfg, args)


ssm.define_vjp(state_space_v1_triton, MAPPING, StateSpaceV1Config)
