"""state_space_v2 on XLA: Mamba-2's chunked SSD algorithm, O(S) memory.

Pure JAX with a backward attached through :func:`ejkernel.plugins.defvjp`.

The recurrence (per head; the state is ``[P, N]``, one scalar decay per head and token):
``h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t``, ``y_t = h_t C_t + D x_t``, gated by
``silu(gate)``. The chunked algorithm is the state-space-duality form of Dao and Gu
("Transformers are SSMs", ICML 2024, Sec. 6, the SSD algorithm): the sequence is cut into
chunks of C tokens and, with ``a_t = Δ_t A`` and ``L_t = Σ_{s ≤ t} a_s`` the cumulative log
decay inside a chunk,

1. intra-chunk (quadratic, all chunks at once): ``Y_diag = (C Bᵀ ⊙ Λ) (Δ ⊙ X)`` with the
   segment-sum decay ``Λ_ts = exp(L_t - L_s)`` for ``s ≤ t`` (the exponent is masked before
   ``exp``, so no decay is ever inverted and nothing overflows);
2. chunk states (all chunks at once): each chunk's own contribution to the state at its end,
   ``Σ_s exp(L_C - L_s) Δ_s x_s ⊗ B_s``;
3. inter-chunk state passing: ``h_{c+1} = exp(L_C) h_c + local_c``, a ``lax.scan`` over chunks
   of one elementwise multiply-add on ``[B, H, P, N]`` (this is where ``initial_state`` enters
   and the final state leaves);
4. state to output (all chunks at once): ``Y_off = exp(L_t) · h_c C_t``.

``y = Y_diag + Y_off + D x``, then the gate. Groups: head h reads ``B``/``C`` group
``h // (H / G)``; the products are taken per group and broadcast over its heads, never
materialising per-head copies of ``B`` or ``C``. A sequence that is not a chunk multiple is
padded with ``Δ = 0`` tokens (decay 1, no input: the state passes through).

Backward (custom VJP). The forward keeps only its inputs; the backward recomputes the chunked
forward and pulls the cotangents back through it with ``jax.vjp``. Every residual of that
autodiff is per chunk (``[S, H, C]`` decays and products, ``[S / C, H, P, N]`` states), so
memory stays linear in S. This is checkpointing of the whole chunked forward, not a
hand-derived backward: it costs one extra forward.

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

_ARRAYS = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")


@attrs.frozen(kw_only=True)
class StateSpaceV2Config:
    """Tunables of the XLA chunked SSD.

    Attributes:
        chunk_size: tokens per chunk C (the op's ``chunk_size`` argument wins over it).
    """

    chunk_size: int = attrs.field(default=64)

    @chunk_size.validator
    def _check(self, attribute: Any, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"StateSpaceV2Config: `chunk_size` must be an int >= 1; got {value!r}")


def heuristic(inv: Any) -> StateSpaceV2Config:
    """The backend's default chunk (or the call's ``chunk_size``), no longer than needed."""
    chunk = inv.kwargs.get("chunk_size") or _DEFAULT_CHUNK[_backend()]
    return StateSpaceV2Config(chunk_size=_fit_chunk(chunk, int(inv.kwargs["x"].shape[1])))


def config_space(inv: Any) -> list[StateSpaceV2Config]:
    """The heuristic's config, then a few chunk lengths (only it when the call fixes one)."""
    configs = [heuristic(inv)]
    if inv.kwargs.get("chunk_size") is not None:
        return configs
    for chunk in _TUNING_CHUNKS:
        cfg = StateSpaceV2Config(chunk_size=_fit_chunk(chunk, int(inv.kwargs["x"].shape[1])))
        if cfg not in configs:
            configs.append(cfg)
    return configs


def state_space_v2_xla(
    *,
    x: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    dt: jax.Array,
    gate: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    initial_state: jax.Array | None = None,
    chunk_size: int | None = None,
    return_state: bool = False,
    cfg: StateSpaceV2Config | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Mamba-2 SSD, chunked (arguments as validated by the core spec).

    Args:
        x: [B, S, H, P].
        A: [H] scalar decay per head.
        B: [B, S, G, N].
        C: [B, S, G, N].
        D: [H].
        dt: [B, S, H].
        gate: [B, S, H, P] or ``None``.
        dt_bias: [H] or ``None``.
        dt_softplus: softplus of ``dt + dt_bias``.
        initial_state: [B, H, P, N] or ``None`` (zeros).
        chunk_size: chunk length; wins over ``cfg``.
        return_state: also return the final state.
        cfg: chunk length; ``None`` takes the default.

    Returns:
        out [B, S, H, P] in the dtype of ``x``, and with ``return_state`` the float32 state.
    """
    arrays = dict(
        x=x, A=A, B=B, C=C, D=D, dt=dt, gate=gate, dt_bias=dt_bias, initial_state=initial_state
    )
    out, final = _forward(arrays, _statics(cfg, chunk_size, dt_softplus))
    return (out, final) if return_state else out


def _state_space_v2_fwd(
    *,
    x: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    dt: jax.Array,
    gate: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    initial_state: jax.Array | None = None,
    chunk_size: int | None = None,
    return_state: bool = False,
    cfg: StateSpaceV2Config | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`state_space_v2_xla`: ``(out, residuals)``; the residuals are the
    array inputs only (the backward recomputes the chunked forward)."""
    arrays = dict(
        x=x, A=A, B=B, C=C, D=D, dt=dt, gate=gate, dt_bias=dt_bias, initial_state=initial_state
    )
    out, final = _forward(arrays, _statics(cfg, chunk_size, dt_softplus))
    return ((out, final) if return_state else out), arrays


def _state_space_v2_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: StateSpaceV2Config | None = None,
    dt_softplus: bool = False,
    chunk_size: int | None = None,
    return_state: bool = False,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`state_space_v2_xla`.

    Returns:
        The gradient of every given array, in its dtype (``None`` for absent ones).
    """
    d_y, d_final = d_out if return_state else (d_out, None)
    return _backward(residuals, d_y, d_final, _statics(cfg, chunk_size, dt_softplus))


defvjp(state_space_v2_xla, _state_space_v2_fwd, _state_space_v2_bwd)


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _backend() -> str:
    name = jax.default_backend().lower()
    name = "gpu" if name in ("cuda", "rocm") else name
    return name if name in _DEFAULT_CHUNK else "cpu"


def _fit_chunk(chunk: int, length: int) -> int:
    """``chunk``, or the smallest power of two covering a shorter sequence."""
    if length >= chunk:
        return chunk
    return 1 << max(0, (length - 1).bit_length())


@attrs.frozen(kw_only=True)
class _Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    chunk: int
    dt_softplus: bool


def _statics(cfg: StateSpaceV2Config | None, chunk_size: int | None, dt_softplus: bool) -> _Statics:
    chunk = chunk_size if chunk_size is not None else (cfg or StateSpaceV2Config()).chunk_size
    return _Statics(chunk=int(chunk), dt_softplus=bool(dt_softplus))


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="st")
def _forward(arrays: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array]:
    """``(out [B, S, H, P], final_state [B, H, P, N])``."""
    return _chunked(arrays, st)


@functools.partial(jax.jit, static_argnames="st")
def _backward(
    arrays: dict[str, Any], d_y: jax.Array, d_final: jax.Array | None, st: _Statics
) -> dict[str, jax.Array | None]:
    """Recompute the chunked forward and pull the cotangents back through it."""
    diff = {n: v for n, v in arrays.items() if v is not None}
    (_, final), pull_back = jax.vjp(lambda a: _chunked({**arrays, **a}, st), diff)
    d_final = jnp.zeros_like(final) if d_final is None else d_final.astype(final.dtype)
    (grads,) = pull_back((d_y.astype(arrays["x"].dtype), d_final))
    return {n: grads.get(n) for n in _ARRAYS}


def _chunked(a: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array]:
    """The SSD algorithm: intra-chunk products, chunk states, state passing, outputs."""
    f32 = lambda v: v.astype(jnp.float32)
    x = a["x"]
    b, s, h, p = x.shape
    g, n = a["B"].shape[2], a["B"].shape[3]
    r = h // g  # heads per group
    c = st.chunk
    m = -(-s // c)

    delta = f32(a["dt"]) if a["dt_bias"] is None else f32(a["dt"]) + f32(a["dt_bias"])
    if st.dt_softplus:
        delta = jax.nn.softplus(delta)

    def chunks(v: jax.Array) -> jax.Array:  # [B, S, ...] -> [B, M, C, ...], zero padded
        v = jnp.pad(f32(v), [(0, 0), (0, m * c - s)] + [(0, 0)] * (v.ndim - 2))
        return v.reshape(b, m, c, *v.shape[2:])

    xc = chunks(x).reshape(b, m, c, g, r, p)
    dc = chunks(delta).reshape(b, m, c, g, r)  # padded steps: Δ = 0
    bc, cc = chunks(a["B"]), chunks(a["C"])  # [B, M, C, G, N]

    t = jnp.arange(c)
    causal = t[:, None] >= t[None, :]
    # Cumulative log decay inside each chunk, as a matmul with a triangle of ones (XLA on CPU
    # would fuse a cumsum into each consumer and redo it per element).
    cum = _dot("ts,bmsgr->bmtgr", causal.astype(jnp.float32), dc * f32(a["A"]).reshape(g, r))
    xdt = xc * dc[..., None]  # Δ_s x_s

    # 1. intra-chunk: Y_diag[t] = Σ_{s ≤ t} (C_t · B_s) exp(L_t - L_s) Δ_s x_s
    segment = jnp.where(
        causal[:, :, None, None], cum[:, :, :, None] - cum[:, :, None, :], -jnp.inf
    )  # [B, M, t, s, G, R]
    scores = _dot("bmtgn,bmsgn->bmtsg", cc, bc)[..., None] * jnp.exp(segment)
    y = _dot("bmtsgr,bmsgrp->bmtgrp", scores, xdt)

    # 2. each chunk's own contribution to the state at its end
    to_end = jnp.exp(cum[:, :, -1:] - cum)  # [B, M, C, G, R]
    local = _dot("bmsgn,bmsgrp->bmgrpn", bc, xdt * to_end[..., None])  # [B, M, G, R, P, N]

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

    y = y.reshape(b, m * c, h, p)[:, :s] + f32(a["D"])[:, None] * f32(x)
    if a["gate"] is not None:
        y = y * jax.nn.silu(f32(a["gate"]))
    return y.astype(x.dtype), final.reshape(b, h, p, n)


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
