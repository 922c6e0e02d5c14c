"""state_space_v2 in Triton: Mamba-2 SSD as chunked linear attention on the gla kernels.

SSD is linear attention with one scalar decay per head and token (Dao and Gu, "Transformers
are SSMs", ICML 2024, Sec. 6). Transposed, the state ``hᵀ [N, P]`` of head h is gla's state
with query ``C_t``, key ``B_t``, value ``Δ_t x_t``, the log gate ``Δ_t A_h`` (the same for
every key channel) and scale 1, so this module maps the call onto
:mod:`ejkernel_triton.ops.gla` (its forward and backward kernels) and does the rest in JAX:

- before the kernels: ``Δ = softplus(dt + dt_bias)`` (as asked), ``Δ x``, the log gate
  ``Δ A`` floored at gla's :data:`~ejkernel_triton.ops.gla.MIN_LOG_DECAY` (``A = -inf`` is a
  state reset where ``Δ > 0``; ``Δ = 0`` passes the state through; ``exp`` of the floor is 0 in
  float32, and its gradient is 0 below it), the group broadcast of ``B``/``C`` and the
  state's transpose;
- after them: ``y + D x`` and the gate ``silu(gate)``.

Backward (the executor's custom VJP): the cotangent is pulled back through the skip and
gate (JAX autodiff), through gla's backward kernels, then through the mapping above (JAX
autodiff of the elementwise preprocessing: the gradients of ``dt``, ``dt_bias``, ``A``, ``x``
and the group sums of ``B``/``C``).

Memory: the kernels read ``B`` and ``C`` per head (``[B, S, H, N]`` copies: the group's rows
are repeated ``H / G`` times) and the scalar log gate broadcast over the ``N`` key channels
(``[B, S, H, N]`` float32), since gla's kernels take per-head keys and a vector gate. A scalar
gate path in the gla kernels would remove both copies.

Config: :class:`StateSpaceV2Config` (gla's tunables). The op's ``chunk_size`` wins over the
config's, taken as the largest of gla's chunks (16, 32, 64) not above it (16 below 16).
:func:`supports` declines an ``x`` dtype other than bf16/f16/f32 and ``N`` or ``P`` over 256.
``B``, ``C`` and ``Δ x`` enter the kernels in ``x``'s dtype; gates and states are float32.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel.specs.state_space_v1 import decay_rate
from ejkernel_triton.ops import gla
from ejkernel_triton.ops.gla_config import GlaConfig
from ejkernel_triton.ops.gla_config import heuristic as gla_heuristic

__all__ = [
    "StateSpaceV2Config",
    "config_space",
    "heuristic",
    "state_space_v2_triton",
    "supports",
]

ARRAYS = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_DIM = 256
_CHUNKS = (16, 32, 64)


@attrs.frozen(kw_only=True)
class StateSpaceV2Config(GlaConfig):
    """Tunables of the Triton SSD: those of the gla kernels it runs on (chunk size, blocks
    over ``N`` (gla's K) and ``P`` (gla's V), warps, stages)."""


def supports(inv: Any) -> bool | str:
    """True, or why not: an ``x`` dtype other than bf16/f16/f32, ``N`` or ``P`` over 256."""
    a = inv.kwargs
    x = a["x"]
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (the Triton kernels take bfloat16, float16, float32)"
    n, p = a["B"].shape[-1], x.shape[-1]
    if max(n, p) > _MAX_DIM:
        return f"N {n} / P {p}: the kernels hold N, P ≤ {_MAX_DIM}"
    return True


def heuristic(inv: Any) -> StateSpaceV2Config:
    """gla's heuristic at the equivalent shape (K = N, V = P); the op's ``chunk_size``, when
    given, sets the chunk."""
    a = inv.kwargs
    x = a["x"]
    b, s, h, _ = x.shape
    query = jax.ShapeDtypeStruct((b, s, h, a["B"].shape[-1]), x.dtype)
    base = gla_heuristic(_Inv({"query": query, "value": x}))
    return _with_chunk(StateSpaceV2Config(**attrs.asdict(base)), a.get("chunk_size"))


def config_space(inv: Any) -> list[StateSpaceV2Config]:
    """The heuristic, then gla's config space at the equivalent shape (one chunk when the
    call fixes it)."""
    a = inv.kwargs
    x = a["x"]
    b, s, h, _ = x.shape
    query = jax.ShapeDtypeStruct((b, s, h, a["B"].shape[-1]), x.dtype)
    out = [heuristic(inv)]
    for cfg in gla.config_space(_Inv({"query": query, "value": x})):
        mine = _with_chunk(StateSpaceV2Config(**attrs.asdict(cfg)), a.get("chunk_size"))
        if mine not in out:
            out.append(mine)
    return out


def _with_chunk(cfg: StateSpaceV2Config, chunk: int | None) -> StateSpaceV2Config:
    """``cfg`` with the op's ``chunk_size`` as one of gla's chunks (the largest not above it)."""
    if chunk is None:
        return cfg
    fitted = max([c for c in _CHUNKS if c <= chunk], default=_CHUNKS[0])
    return attrs.evolve(cfg, chunk_size=fitted)


@attrs.frozen
class _Inv:
    kwargs: dict[str, Any]


# -- the op ---------------------------------------------------------------------------------


def state_space_v2_triton(*, cfg: StateSpaceV2Config | None = None, **args: Any) -> Any:
    """Mamba-2 SSD through the Triton gla kernels.

    Args:
        **args: the arguments of :func:`ejkernel.specs.state_space_v2.state_space_v2`, by
            name, as the core spec validated them.
        cfg: the gla kernels' tunables; ``None`` takes the heuristic's.

    Returns:
        out [B, S, H, P] in the dtype of ``x``, or ``(out, final_state [B, H, P, N] float32)``
        when ``return_state``.
    """
    return _ssd_fwd(cfg=cfg, **args)[0]


def _ssd_fwd(*, cfg: StateSpaceV2Config | None = None, **args: Any) -> tuple[Any, dict[str, Any]]:
    """Forward: ``(out or (out, final_state), residuals)``; the residuals are the array
    inputs, gla's residuals and ``y = C h``."""
    a = {n: args.get(n) for n in ARRAYS}
    rs = bool(args.get("return_state"))
    cfg = _config(cfg, args)
    lin = _as_linear(a, bool(args.get("dt_softplus")))
    out, res = gla._gla_fwd(cfg=cfg, **lin, softmax_scale=1.0, return_state=rs)
    y, final = out if rs else (out, None)
    o = _skip_and_gate(y, a["x"], a["D"], a["gate"]).astype(a["x"].dtype)
    if rs:
        o = (o, jnp.swapaxes(final, -1, -2))
    return o, {"arrays": a, "gla": res, "y": y}


def _ssd_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: StateSpaceV2Config | None = None,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """Backward: the gradient of every given array, in its dtype (``None`` for absent ones)."""
    a, y = residuals["arrays"], residuals["y"]
    rs = bool(statics.get("return_state"))
    d_o, d_final = d_out if rs else (d_out, None)

    outer = {n: a[n] for n in ("x", "D", "gate") if a[n] is not None}
    _, pull_outer = jax.vjp(lambda o, y: _skip_and_gate(y, o["x"], o["D"], o.get("gate")), outer, y)
    d_outer, d_y = pull_outer(d_o.astype(jnp.float32))

    d_state = None
    if rs and d_final is not None:
        d_state = jnp.swapaxes(d_final.astype(jnp.float32), -1, -2)
    res = residuals["gla"]
    kernel_cfg = _config(cfg, {**statics, "x": a["x"], "B": a["B"]})
    st = gla._Statics.of({"query": res["q"], "value": res["v"], "softmax_scale": 1.0}, kernel_cfg)
    st = attrs.evolve(st, return_state=rs, chunk=res["layout"].chunk)
    d_lin = gla._backward(res, d_y.astype(res["q"].dtype), d_state, st, split_diagonal=True)

    diff = {n: a[n] for n in ARRAYS if a[n] is not None}
    softplus = bool(statics.get("dt_softplus"))
    lin, pull_lin = jax.vjp(lambda d: _as_linear({**a, **d}, softplus), diff)
    cot = {
        n: None if v is None else d_lin.get(n, jnp.zeros_like(v)).astype(v.dtype)
        for n, v in lin.items()
        if n != "cu_seqlens"
    }
    cot["cu_seqlens"] = None
    (grads,) = pull_lin(cot)
    grads = {n: g + d_outer[n] if n in d_outer else g for n, g in grads.items()}
    return {n: None if a[n] is None else grads[n].astype(a[n].dtype) for n in ARRAYS}


defvjp(state_space_v2_triton, _ssd_fwd, _ssd_bwd)


def _config(cfg: StateSpaceV2Config | None, args: dict[str, Any]) -> StateSpaceV2Config:
    """The config the kernels run (the heuristic's when ``None``), the op's chunk winning."""
    if cfg is None:
        return heuristic(_Inv(args))
    return _with_chunk(cfg, args.get("chunk_size"))


# -- the mapping onto gla -------------------------------------------------------------------


def _delta(a: dict[str, Any], softplus: bool) -> jax.Array:
    """``Δ = dt + dt_bias``, then ``softplus(Δ)`` when asked; float32 [B, S, H]."""
    d = a["dt"].astype(jnp.float32)
    if a["dt_bias"] is not None:
        d = d + a["dt_bias"].astype(jnp.float32)
    return jax.nn.softplus(d) if softplus else d


def _as_linear(a: dict[str, Any], softplus: bool) -> dict[str, Any]:
    """gla's arrays: query ``C`` and key ``B`` per head [B, S, H, N] and value ``Δ x``
    [B, S, H, P] in ``x``'s dtype, the log gate ``Δ A`` broadcast over N [B, S, H, N] and the
    initial state ``h₀ᵀ`` [B, H, N, P], float32."""
    x = a["x"]
    dtype = x.dtype
    h = x.shape[2]
    n = a["B"].shape[-1]
    heads = h // a["B"].shape[2]
    per_head = lambda v: jnp.repeat(v.astype(dtype), heads, axis=2)
    d = _delta(a, softplus)
    log_decay = jnp.maximum(d * decay_rate(a["A"]), gla.MIN_LOG_DECAY)
    init = a["initial_state"]
    return {
        "query": per_head(a["C"]),
        "key": per_head(a["B"]),
        "value": (d[..., None] * x.astype(jnp.float32)).astype(dtype),
        "g": jnp.broadcast_to(log_decay[..., None], (*log_decay.shape, n)),
        "initial_state": None if init is None else jnp.swapaxes(init.astype(jnp.float32), -1, -2),
        "cu_seqlens": None,
    }


def _skip_and_gate(y: jax.Array, x: jax.Array, skip: jax.Array, gate: jax.Array | None) -> Any:
    """``(y + D x) ⊙ silu(gate)`` in float32 (``D`` per head, broadcast over its channels)."""
    out = y.astype(jnp.float32) + skip.astype(jnp.float32)[:, None] * x.astype(jnp.float32)
    if gate is not None:
        out = out * jax.nn.silu(gate.astype(jnp.float32))
    return out
