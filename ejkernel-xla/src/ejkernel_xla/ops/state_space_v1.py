"""state_space_v1 on XLA: Mamba-1's selective scan, chunked, with O(S / C) saved states.

Pure JAX with a hand-written backward attached through :func:`ejkernel.plugins.defvjp`.

The recurrence is diagonal, one decay per channel and state entry:
``h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) B_t`` (state ``[I, N]``), ``y_t = h_t C_t``; then
``out = (y + D x) ⊙ silu(gate)``. Unlike SSD, the decay differs per (channel, state) entry, so
there is no matmul form (Gu and Dao, "Mamba", 2023, Sec. 3.3): the work is elementwise on
``[I, N]`` per token, and the state must exist per token to form ``y_t``.

Forward. The sequence is cut into chunks of C tokens and a ``lax.scan`` runs over chunks,
carrying the state; the forward keeps each chunk's incoming state (``[S / C, I, N]``) and
``y`` for the backward, never a state per token. A chunk is solved one of two ways (config
``intra_chunk``):

- ``"associative"``: in parallel over its tokens with ``lax.associative_scan`` over the pairs
  ``(a_t, b_t) = (exp(Δ_t A), Δ_t x_t B_t)`` and the combine
  ``(a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂, a₂ b₁ + b₂)`` (Blelloch, 1990; the parallel scan of Mamba's
  hardware-aware algorithm, Sec. 3.3.2): ``h_t = a_{1..t} h₀ + b_{1..t}``, no decay is ever
  divided by, so nothing overflows. Only one chunk's ``[C, I, N]`` states exist at a time.
  The default on accelerators.
- ``"sequential"``: a token loop. The default on CPU, where it is 4-6x faster: the work is
  elementwise, so the loop loses no matmul, and it keeps the ``[I, N]`` state in cache while
  the parallel scan makes log₂ C passes over ``[C, I, N]`` temporaries.

A sequence that is not a chunk multiple is padded with ``Δ = 0`` tokens (the state passes
through). The log decay ``Δ A`` is taken by ``_state_space.log_decay``: ``A = -inf`` forgets
the state (decay 0, zero gradients) wherever ``Δ > 0`` and padding still passes it through.

Backward (custom VJP). ``out = (y + D x) silu(gate)`` is pulled back directly (``y`` saved);
then a reverse ``lax.scan`` over chunks recomputes one chunk from its saved incoming state and
pulls ``dy`` and the carried state cotangent back through it with ``jax.vjp``, handing the
state cotangent to the previous chunk and summing ``dA``; finally ``Δ``'s bias and softplus
are pulled back once. Memory stays one chunk's states plus the saved per-chunk states.

Everything is float32 inside; outputs keep the dtype of ``x``, the final state is float32.
Config: ``chunk_size`` (C) and ``intra_chunk``. It declines nothing (no ``supports``): every valid call runs here, on
every backend.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.plugins import defvjp
from ejkernel_xla.ops import _state_space as ssm
from ejkernel_xla.ops._tuning import backend, check_chunk_size, distinct

__all__ = [
    "StateSpaceV1Config",
    "config_space",
    "heuristic",
    "state_space_v1_xla",
]

#: Default chunk length C per backend.
_DEFAULT_CHUNK: dict[str, int] = {"cpu": 64, "gpu": 128, "tpu": 128}
#: Default intra-chunk solver per backend. On CPU the token loop is 4-6x faster than the
#: parallel scan (T 4096, I 512, N 16: 61 ms against 230-330 ms for C 16..64, on 2 cores):
#: the work is elementwise and the loop keeps the [I, N] state in cache, while the parallel
#: scan does log2(C) passes over [C, I, N] temporaries. Accelerators want the parallelism.
_DEFAULT_INTRA: dict[str, str] = {"cpu": "sequential", "gpu": "associative", "tpu": "associative"}
#: (chunk_size, intra_chunk) pairs :func:`config_space` offers.
_TUNING: tuple[tuple[int, str], ...] = (
    (64, "sequential"),
    (256, "sequential"),
    (16, "associative"),
    (64, "associative"),
    (128, "associative"),
)
_INTRA = ("sequential", "associative")


@attrs.frozen(kw_only=True)
class StateSpaceV1Config:
    """Tunables of the XLA chunked selective scan.

    Attributes:
        chunk_size: tokens per chunk C: the ``lax.scan`` runs over S / C chunks, the backward
            keeps one state per chunk and recomputes one chunk at a time.
        intra_chunk: how a chunk is solved: ``"associative"`` (a parallel scan over its C
            tokens) or ``"sequential"`` (a token loop).
    """

    chunk_size: int = attrs.field(default=64, validator=check_chunk_size)
    intra_chunk: str = attrs.field(default="associative")

    @intra_chunk.validator
    def _check_intra(self, attribute: Any, value: Any) -> None:
        if value not in _INTRA:
            raise ValueError(
                f"StateSpaceV1Config: `intra_chunk` must be one of {_INTRA}; got {value!r}"
            )


def heuristic(inv: Any) -> StateSpaceV1Config:
    """The backend's default chunk and intra-chunk solver; the chunk shrunk to a power of two
    for shorter sequences."""
    name = backend(_DEFAULT_CHUNK)
    return StateSpaceV1Config(
        chunk_size=ssm.fitted(inv, _DEFAULT_CHUNK[name]), intra_chunk=_DEFAULT_INTRA[name]
    )


def config_space(inv: Any) -> list[StateSpaceV1Config]:
    """The heuristic's config, then a few (chunk, solver) pairs fitted to the sequence."""
    tuned = (StateSpaceV1Config(chunk_size=ssm.fitted(inv, c), intra_chunk=i) for c, i in _TUNING)
    return distinct([heuristic(inv), *tuned])


def state_space_v1_xla(
    *, cfg: StateSpaceV1Config | None = None, **args: Any
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Mamba-1 selective scan, chunked: the op's arguments
    (:func:`ejkernel.specs.state_space_v1.state_space_v1`, validated by the core) as keywords,
    and the chunk length and solver ``cfg`` (``None``: the defaults).

    Returns:
        out [B, S, I] in the dtype of ``x``, and with ``return_state`` the float32 state.
    """
    return _run(args, cfg, save=False)[0]


def _state_space_v1_fwd(
    *, cfg: StateSpaceV1Config | None = None, **args: Any
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`state_space_v1_xla`: ``(out, residuals)``.

    The residuals are the array inputs, ``y = C h`` ``[B, S, I]`` and every chunk's incoming
    state ``[S / C, B, I, N]`` (float32).
    """
    out, arrays, (y, states) = _run(args, cfg, save=True)
    return out, {**arrays, "y": y, "states": states}


def _state_space_v1_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: StateSpaceV1Config | None = None,
    return_state: bool = False,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`state_space_v1_xla`.

    Returns:
        The gradient of every given array, in its dtype (``None`` for absent ones).
    """
    d_o, d_final = d_out if return_state else (d_out, None)
    arrays = {k: v for k, v in residuals.items() if k not in ("y", "states")}
    return _backward(
        arrays, residuals["y"], residuals["states"], d_o, d_final, _statics(cfg, **statics)
    )


defvjp(state_space_v1_xla, _state_space_v1_fwd, _state_space_v1_bwd)


def _run(args: dict[str, Any], cfg: StateSpaceV1Config | None, save: bool) -> tuple[Any, ...]:
    """``(out or (out, final_state), arrays, (y, incoming states) or None)``."""
    arrays = ssm.arrays(args)
    out, final, saved = _forward(arrays, _statics(cfg, **args), save=save)
    return ((out, final) if args.get("return_state") else out), arrays, saved


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    chunk: int
    intra_chunk: str
    dt_softplus: bool


def _statics(
    cfg: StateSpaceV1Config | None, *, dt_softplus: bool = False, **unused: Any
) -> _Statics:
    """The passes' statics from the config and the op's ``dt_softplus``."""
    del unused  # the arrays and return_state
    cfg = cfg or StateSpaceV1Config()
    return _Statics(
        chunk=cfg.chunk_size, intra_chunk=cfg.intra_chunk, dt_softplus=bool(dt_softplus)
    )


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


class _Chunks(NamedTuple):
    """Per-chunk inputs, float32, [M, B, C, ...]."""

    x: jax.Array  # [..., I]
    delta: jax.Array  # [..., I], Δ after bias and softplus; 0 on padding
    b: jax.Array  # [..., N]
    c: jax.Array  # [..., N]


def _prepare(a: dict[str, Any], st: _Statics) -> _Chunks:
    """Δ from dt (bias, softplus), float32, laid out in chunks ``[M, B, C, ...]``."""
    d = ssm.delta(a["dt"], a["dt_bias"], st.dt_softplus)
    chunks = lambda v: _to_chunks(v, st.chunk)
    return _Chunks(x=chunks(a["x"]), delta=chunks(d), b=chunks(a["B"]), c=chunks(a["C"]))


def _to_chunks(v: jax.Array, c: int) -> jax.Array:
    """[B, S, F] -> [M, B, C, F] float32, zero padded."""
    b, s, f = v.shape
    m = -(-s // c)
    v = jnp.pad(v.astype(jnp.float32), [(0, 0), (0, m * c - s), (0, 0)])
    return jnp.moveaxis(v.reshape(b, m, c, f), 1, 0)


def _initial_state(a: dict[str, Any]) -> jax.Array:
    init = a["initial_state"]
    if init is not None:
        return init.astype(jnp.float32)
    return jnp.zeros((a["x"].shape[0], *a["A"].shape), jnp.float32)


@functools.partial(jax.jit, static_argnames=("st", "save"))
def _forward(a: dict[str, Any], st: _Statics, save: bool) -> tuple[jax.Array, jax.Array, Any]:
    """``(out, final_state, (y, incoming states) or None)``."""
    s = a["x"].shape[1]
    chunks = _prepare(a, st)
    decay_rate = a["A"].astype(jnp.float32)
    solve = _CHUNK_SOLVERS[st.intra_chunk]

    def body(h: jax.Array, ch: _Chunks) -> tuple[jax.Array, Any]:
        y, new = solve(h, ch, decay_rate)
        return new, ((y, h) if save else (y, None))

    final, (y, states) = lax.scan(body, _initial_state(a), chunks)
    y = _unchunk(y, s)
    out = ssm.skip_and_gate(y, a["x"], a["D"], a["gate"]).astype(a["x"].dtype)
    return out, final, ((y, states) if save else None)


@functools.partial(jax.jit, static_argnames="st")
def _backward(
    a: dict[str, Any],
    y: jax.Array,
    states: jax.Array,
    d_o: jax.Array,
    d_final: jax.Array | None,
    st: _Statics,
) -> dict[str, jax.Array | None]:
    """Pull back the gate, then a reverse scan over chunks, then Δ's bias and softplus."""
    d_outer, d_y = ssm.pull_skip_and_gate(a, y, d_o)

    inner = {n: a[n] for n in ("x", "dt", "dt_bias", "B", "C") if a[n] is not None}
    chunks, pull_prepare = jax.vjp(lambda i: _prepare({**a, **i}, st), inner)
    d_y = _to_chunks(d_y, st.chunk)
    decay_rate = a["A"].astype(jnp.float32)
    init = _initial_state(a)
    d_h = jnp.zeros_like(init) if d_final is None else d_final.astype(jnp.float32)
    solve = _CHUNK_SOLVERS[st.intra_chunk]

    def body(carry: Any, xs: Any) -> tuple[Any, _Chunks]:
        d_h, d_rate = carry
        ch, h, d_y_m = xs
        _, vjp = jax.vjp(solve, h, ch, decay_rate)
        d_h, d_ch, d_rate_m = vjp((d_y_m, d_h))
        return (d_h, d_rate + d_rate_m), d_ch

    (d_h0, d_rate), d_chunks = lax.scan(
        body, (d_h, jnp.zeros_like(decay_rate)), (chunks, states, d_y), reverse=True
    )
    (grads,) = pull_prepare(d_chunks)
    grads["x"] = grads["x"] + d_outer["x"]
    out = {n: grads.get(n, d_outer.get(n)) for n in ("x", "B", "C", "D", "dt", "gate", "dt_bias")}
    out["A"] = d_rate.astype(a["A"].dtype)
    out["initial_state"] = (
        None if a["initial_state"] is None else d_h0.astype(a["initial_state"].dtype)
    )
    return out


def _unchunk(y: jax.Array, s: int) -> jax.Array:
    """[M, B, C, I] -> [B, S, I]."""
    m, b, c, i = y.shape
    return jnp.moveaxis(y, 0, 1).reshape(b, m * c, i)[:, :s]


def _chunk_associative(h: jax.Array, ch: _Chunks, rate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk by a parallel scan: ``(y [B, C, I], state after it [B, I, N])``."""
    decay = jnp.exp(ssm.log_decay(ch.delta[..., None], rate))  # [B, C, I, N], ≤ 1 for A ≤ 0
    drive = (ch.delta * ch.x)[..., None] * ch.b[:, :, None, :]
    decay, drive = lax.associative_scan(_combine, (decay, drive), axis=1)
    states = decay * h[:, None] + drive  # h_t for every t of the chunk
    y = jnp.einsum("bcin,bcn->bci", states, ch.c, preferred_element_type=jnp.float32)
    return y, states[:, -1]


def _combine(
    first: tuple[jax.Array, jax.Array], second: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Compose two affine steps ``h -> a h + b`` (first, then second)."""
    a1, b1 = first
    a2, b2 = second
    return a1 * a2, a2 * b1 + b2


def _chunk_sequential(h: jax.Array, ch: _Chunks, rate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk by a token loop: ``(y [B, C, I], state after it [B, I, N])``."""

    def step(h: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        x_t, d_t, b_t, c_t = xs
        decay = jnp.exp(ssm.log_decay(d_t[..., None], rate))
        h = decay * h + (d_t * x_t)[..., None] * b_t[:, None, :]
        return h, jnp.einsum("bin,bn->bi", h, c_t, preferred_element_type=jnp.float32)

    time_major = lambda v: jnp.moveaxis(v, 1, 0)
    h, y = lax.scan(step, h, tuple(map(time_major, ch)))
    return jnp.moveaxis(y, 0, 1), h


_CHUNK_SOLVERS = {"associative": _chunk_associative, "sequential": _chunk_sequential}
