"""state_space_v2 on XLA: Mamba-2's chunked SSD algorithm, O(S) memory.

Pure JAX with a backward attached through :func:`ejkernel.plugins.defvjp`.

The recurrence (per head; the state is ``[P, N]``, one scalar decay per head and token):
``h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t``, ``y_t = h_t C_t + D x_t``, gated by
``silu(gate)``. Transposed, ``hᵀ [N, P]`` is the state of ``recurrent`` with query ``C_t``,
key ``B_t``, value ``Δ_t x_t``, the per-head scalar log gate ``Δ_t A`` and scale 1.

Forward: the state-space-duality form of Dao and Gu ("Transformers are SSMs", ICML 2024,
Sec. 6, the SSD algorithm). The sequence is cut into chunks of C tokens and, with
``a_t = Δ_t A`` and ``L_t = Σ_{s ≤ t} a_s`` the cumulative log decay inside a chunk,

1. intra-chunk (quadratic, all chunks at once): ``Y_diag = (C Bᵀ ⊙ Λ) (Δ ⊙ X)`` with the
   segment-sum decay ``Λ_ts = exp(L_t - L_s)`` for ``s ≤ t`` (the exponent is masked before
   ``exp``, so no decay is ever inverted and nothing overflows);
2. chunk states (all chunks at once): each chunk's own contribution to the state at its end,
   ``Σ_s exp(L_C - L_s) Δ_s x_s ⊗ B_s``;
3. inter-chunk state passing: ``h_{c+1} = exp(L_C) h_c + local_c``, a ``lax.scan`` over chunks
   of one elementwise multiply-add on ``[B, H, P, N]`` (this is where ``initial_state`` enters
   and the final state leaves);
4. state to output (all chunks at once): ``Y_off = exp(L_t) · h_c C_t``.

``y = Y_diag + Y_off + D x``, then the gate. ``Δ A`` is floored at -110
(``_state_space.log_decay``: ``A = -inf`` is a reset at every token, padding passes the state
through); a token with a non-finite ``Δ A`` or ``Δ x`` enters with it zeroed and its outputs
from there on are NaN, so a NaN reaches only its causal future (``_chunk_numerics``). Groups: head h reads ``B``/``C`` group
``h // (H / G)``; the products are taken per group and broadcast over its heads, never
materialising per-head copies of ``B`` or ``C``. A sequence that is not a chunk multiple is
padded with ``Δ = 0`` tokens (decay 1, no input: the state passes through). On CPU this
all-chunks-at-once forward is faster than the linear-attention engine's streamed forward.

Backward (custom VJP), on the chunked engine of :mod:`ejkernel_xla.ops._chunked` (its
scalar-gate path). The forward saves its inputs, ``y = C h`` and every chunk's incoming state
``h_c`` (step 3), which are the engine's chunk-start states; the backward pulls the cotangent
back through the gate and skip, through the engine's backward (a reverse scan over chunks,
then every chunk recomputed from its saved start state), then through the mapping onto the
engine (``Δ``'s bias and softplus, ``Δ x``, ``Δ A``, the group broadcast). Memory stays
linear in S.

Everything is float32 inside; outputs keep the dtype of ``x``, the final state is float32.
Config: ``chunk_size`` (C); the op's ``chunk_size`` argument, when given, wins over it.
It declines nothing (no ``supports``): every valid call runs here, on every backend.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.plugins import defvjp
from ejkernel_xla.ops import _state_space as ssm
from ejkernel_xla.ops._chunk_numerics import finite_part, poison
from ejkernel_xla.ops._chunked import (
    LinearStatics,
    linear_attention_backward,
)
from ejkernel_xla.ops._tuning import backend, check_chunk_size, distinct

__all__ = [
    "StateSpaceV2Config",
    "config_space",
    "heuristic",
    "state_space_v2_xla",
]

#: Default chunk length C per backend: Mamba-2's 256 on GPUs; 64 measured fastest on CPU
#: (T 4096, H 8, P 64, N 64, among 32..256).
_DEFAULT_CHUNK: dict[str, int] = {"cpu": 64, "gpu": 256, "tpu": 256}
#: Chunk lengths :func:`config_space` offers.
_TUNING_CHUNKS: tuple[int, ...] = (32, 64, 128, 256)


@attrs.frozen(kw_only=True)
class StateSpaceV2Config:
    """Tunables of the XLA chunked SSD.

    Attributes:
        chunk_size: tokens per chunk C (the op's ``chunk_size`` argument wins over it).
    """

    chunk_size: int = attrs.field(default=64, validator=check_chunk_size)


def heuristic(inv: Any) -> StateSpaceV2Config:
    """The backend's default chunk (or the call's ``chunk_size``), no longer than needed."""
    chunk = inv.kwargs.get("chunk_size") or _DEFAULT_CHUNK[backend(_DEFAULT_CHUNK)]
    return StateSpaceV2Config(chunk_size=ssm.fitted(inv, chunk))


def config_space(inv: Any) -> list[StateSpaceV2Config]:
    """The heuristic's config, then a few chunk lengths (only it when the call fixes one)."""
    if inv.kwargs.get("chunk_size") is not None:
        return [heuristic(inv)]
    tuned = (StateSpaceV2Config(chunk_size=ssm.fitted(inv, c)) for c in _TUNING_CHUNKS)
    return distinct([heuristic(inv), *tuned])


def state_space_v2_xla(
    *, cfg: StateSpaceV2Config | None = None, **args: Any
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Mamba-2 SSD, chunked: the op's arguments
    (:func:`ejkernel.specs.state_space_v2.state_space_v2`, validated by the core) as keywords,
    and the chunk length ``cfg`` (``None``: the default; the op's ``chunk_size`` wins over it).

    Returns:
        out [B, S, H, P] in the dtype of ``x``, and with ``return_state`` the float32 state.
    """
    return _forward(ssm.arrays(args), _statics(cfg, **args), False)[0]


def _state_space_v2_fwd(
    *, cfg: StateSpaceV2Config | None = None, **args: Any
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`state_space_v2_xla`: ``(out, residuals)``; the residuals are the
    array inputs, ``y = C h`` and the engine's chunk-start states."""
    arrays = ssm.arrays(args)
    out, (y, h_start) = _forward(arrays, _statics(cfg, **args), True)
    return out, {"arrays": arrays, "y": y, "h_start": h_start}


def _state_space_v2_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: StateSpaceV2Config | None = None,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`state_space_v2_xla`.

    Returns:
        The gradient of every given array, in its dtype (``None`` for absent ones).
    """
    st = _statics(cfg, **statics)
    d_y, d_final = d_out if st.linear.return_state else (d_out, None)
    return _backward(residuals["arrays"], residuals["y"], residuals["h_start"], d_y, d_final, st)


defvjp(state_space_v2_xla, _state_space_v2_fwd, _state_space_v2_bwd)


# --------------------------------------------------------------------------------------------
# Forward (SSD) and backward (the linear-attention engine)
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    linear: LinearStatics
    dt_softplus: bool


def _statics(
    cfg: StateSpaceV2Config | None,
    *,
    chunk_size: int | None = None,
    dt_softplus: bool = False,
    return_state: bool = False,
    **unused: Any,
) -> _Statics:
    """The passes' statics from the config and the op's non-array arguments."""
    del unused  # the arrays
    chunk = int(chunk_size if chunk_size is not None else (cfg or StateSpaceV2Config()).chunk_size)
    # The engine's scalar-gate path has no sub-chunks: one sub-chunk per chunk keeps any C valid.
    linear = LinearStatics(
        scale=1.0, reverse=False, return_state=bool(return_state), chunk=chunk, sub_chunk=chunk
    )
    return _Statics(linear=linear, dt_softplus=bool(dt_softplus))


def _ssd_gates(a: dict[str, Any]) -> tuple[jax.Array, None]:
    """The per-head scalar log gate ``Δ A`` [B, S, H, 1]; no value gate."""
    return a["g"][..., None], None


def _as_linear(a: dict[str, Any], st: _Statics) -> dict[str, Any]:
    """The engine's arrays (float32): query ``C`` and key ``B`` per head [B, S, H, N], value
    ``Δ x`` [B, S, H, P], log gate ``Δ A`` [B, S, H], initial state ``h₀ᵀ`` [B, H, N, P]."""
    x = a["x"].astype(jnp.float32)
    heads = x.shape[2] // a["B"].shape[2]
    per_head = lambda v: jnp.repeat(v.astype(jnp.float32), heads, axis=2)
    d = ssm.delta(a["dt"], a["dt_bias"], st.dt_softplus)
    init = a["initial_state"]
    return {
        "query": per_head(a["C"]),
        "key": per_head(a["B"]),
        "value": d[..., None] * x,
        "g": ssm.log_decay(d, a["A"]),
        "initial_state": None if init is None else jnp.swapaxes(init.astype(jnp.float32), -1, -2),
    }


@functools.partial(jax.jit, static_argnames=("st", "save"))
def _forward(a: dict[str, Any], st: _Statics, save: bool) -> tuple[Any, Any]:
    """``(out or (out, final_state), (y, chunk-start states [M, B, H, N, P]) or None)``."""
    y, final, states = _ssd(a, st)
    out = ssm.skip_and_gate(y, a["x"], a["D"], a["gate"]).astype(a["x"].dtype)
    if st.linear.return_state:
        out = (out, final)
    if not save:
        return out, None
    b, m, g, r, p, n = states.shape
    h_start = states.reshape(b, m, g * r, p, n).transpose(1, 0, 2, 4, 3)  # the engine's layout
    return out, (y, h_start)


@functools.partial(jax.jit, static_argnames="st")
def _backward(
    a: dict[str, Any],
    y: jax.Array,
    h_start: jax.Array,
    d_y: jax.Array,
    d_final: jax.Array | None,
    st: _Statics,
) -> dict[str, jax.Array | None]:
    """Pull back the gate and skip, then the engine's backward, then the mapping onto it."""
    d_outer, d_lin_y = ssm.pull_skip_and_gate(a, y, d_y)

    diff = {n: a[n] for n in ssm.ARRAYS if a[n] is not None}
    linear, pull_linear = jax.vjp(lambda d: _as_linear({**a, **d}, st), diff)
    d_out: Any = d_lin_y
    if st.linear.return_state:
        final = None if d_final is None else jnp.swapaxes(d_final.astype(jnp.float32), -1, -2)
        d_out = (d_lin_y, final)
    d_linear = linear_attention_backward(
        {"arrays": linear, "h_start": h_start}, d_out, st.linear, _ssd_gates
    )
    (grads,) = pull_linear({n: d_linear.get(n) for n in linear})
    grads = {n: g + d_outer[n] if n in d_outer else g for n, g in grads.items()}
    return {n: None if a[n] is None else grads[n].astype(a[n].dtype) for n in ssm.ARRAYS}


def _ssd(a: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The SSD algorithm: intra-chunk products, chunk states, state passing, outputs.

    Returns ``y = C h`` [B, S, H, P] (before the skip and gate), the final state
    [B, H, P, N] and every chunk's incoming state [B, M, G, R, P, N], all float32.
    """
    f32 = lambda v: v.astype(jnp.float32)
    x = a["x"]
    b, s, h, p = x.shape
    g, n = a["B"].shape[2], a["B"].shape[3]
    r = h // g  # heads per group
    c = st.linear.chunk
    m = -(-s // c)
    d = ssm.delta(a["dt"], a["dt_bias"], st.dt_softplus)
    # Δ A floored (A = -inf resets the state); a token whose Δ A or B is not finite enters
    # with them and Δ x zeroed, a non-finite Δ x entry alone is zeroed, and the outputs from
    # there on are NaN (the triangular products below would carry it into earlier rows:
    # _chunk_numerics).
    la = ssm.log_decay(d, a["A"])
    b_ok = jnp.all(jnp.isfinite(a["B"]), axis=-1)  # [B, S, G]
    ok = jnp.isfinite(la) & jnp.repeat(b_ok, r, axis=2)
    la = jnp.where(ok, la, 0.0)

    def chunks(v: jax.Array) -> jax.Array:  # [B, S, ...] -> [B, M, C, ...], zero padded
        v = jnp.pad(f32(v), [(0, 0), (0, m * c - s)] + [(0, 0)] * (v.ndim - 2))
        return v.reshape(b, m, c, *v.shape[2:])

    # Padded steps: Δ A = 0 and Δ x = 0 (the state passes through).
    xdt_raw = chunks(d[..., None] * f32(x)).reshape(b, m, c, g, r, p)  # Δ_s x_s
    bad = chunks(~ok).reshape(b, m, c, g, r, 1) > 0  # padding: not bad
    xdt, first = finite_part(xdt_raw, axis=2, also=~bad)
    bc_raw, cc = chunks(a["B"]), chunks(a["C"])  # [B, M, C, G, N]
    bc = jnp.where(chunks(b_ok)[..., None] > 0, bc_raw, 0.0)

    t = jnp.arange(c)
    causal = t[:, None] >= t[None, :]
    # Cumulative log decay inside each chunk, as a matmul with a triangle of ones (XLA on CPU
    # would fuse a cumsum into each consumer and redo it per element).
    cum = _dot("ts,bmsgr->bmtgr", causal.astype(jnp.float32), chunks(la).reshape(b, m, c, g, r))

    # 1. intra-chunk: Y_diag[t] = Σ_{s ≤ t} (C_t · B_s) exp(L_t - L_s) Δ_s x_s
    segment = jnp.where(
        causal[:, :, None, None], cum[:, :, :, None] - cum[:, :, None, :], -jnp.inf
    )  # [B, M, t, s, G, R]
    scores = _dot("bmtgn,bmsgn->bmtsg", cc, bc)[..., None] * jnp.exp(segment)
    y = _dot("bmtsgr,bmsgrp->bmtgrp", scores, xdt)

    # 2. each chunk's own contribution to the state at its end, from the inputs as given: a
    # non-finite one makes the state non-finite where the recurrence's would be
    to_end = jnp.exp(cum[:, :, -1:] - cum)  # [B, M, C, G, R]
    local = _dot("bmsgn,bmsgrp->bmgrpn", bc_raw, xdt_raw * to_end[..., None])  # [B, M, G, R, P, N]

    # 3. state passing between chunks
    chunk_decay = jnp.exp(cum[:, :, -1])[..., None, None]  # [B, M, G, R, 1, 1]
    init = a["initial_state"]
    h0 = (
        jnp.zeros((b, g, r, p, n), jnp.float32)
        if init is None
        else f32(init).reshape(b, g, r, p, n)
    )

    def step(state: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        decay, contribution = xs
        return decay * state + contribution, state

    final, states = lax.scan(step, h0, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(local, 1, 0)))
    states = jnp.moveaxis(states, 0, 1)  # incoming state of each chunk [B, M, G, R, P, N]

    # 4. Y_off[t] = exp(L_t) h_c C_t
    y = y + jnp.exp(cum)[..., None] * _dot("bmtgn,bmgrpn->bmtgrp", cc, states)
    y = poison(y, first, axis=2)

    return y.reshape(b, m * c, h, p)[:, :s], final.reshape(b, h, p, n), states


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
