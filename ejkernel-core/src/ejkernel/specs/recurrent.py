"""recurrent: gated linear recurrence (linear attention with log-space gates), forward and backward.

Semantics every implementation follows (OPS.md vocabulary), for each head:

- ``h_t = h_{t-1} ⊙ exp(g_t + gk_t)[:, None] ⊙ exp(gv_t)[None, :] + k_tᵀ v_t`` with
  ``h [K, V]``, and ``o_t = softmax_scale · q_t h_t``. Gates are log-space decays (a gate of 0
  keeps the state); an absent gate is 0. ``softmax_scale`` scales the query (no softmax is
  taken); default ``K ** -0.5``.
- A gate of ``-inf`` is a state reset: its decay is exactly 0 (``exp(-inf)``), so the state
  after that token is ``k_tᵀ v_t`` alone, and gradients stay finite (0 through the reset
  gate). Gates are accumulated in float32; log decays as strong as -20 per step over long
  sequences stay finite.
- A NaN or inf at token t (in any input) reaches only the outputs of token t and the tokens
  after it in its sequence (before it with ``reverse``), as the recurrence carries it in its
  state; no output before it depends on it.
- ``reverse=True`` runs the same recurrence from the last token to the first (each packed
  sequence on its own), as flash-linear-attention's ``fused_recurrent`` does: token t then sees
  tokens ≥ t, and the final state is the one after token 0.
- ``initial_state [N, H, K, V]`` (zeros when absent) is the state before the first token of each
  sequence; ``N = B``, or the number of packed sequences with ``cu_seqlens``.
- ``cu_seqlens [N + 1]`` (integer, non-decreasing, ``B == 1``) packs N sequences along the token
  axis: sequence n is tokens ``[cu_seqlens[n], cu_seqlens[n + 1])``; the state resets to
  ``initial_state[n]`` at its start. Tokens outside ``[cu_seqlens[0], cu_seqlens[N])`` belong
  to no sequence: their output is zero and they touch no state. An empty sequence's final state
  is its initial state. The offsets' values are not checked (they may be traced).
- ``return_state=True`` returns ``(out, final_state)`` with ``final_state [N, H, K, V]`` float32
  (the state after each sequence's last token); otherwise ``out``.

Accumulation is float32; ``out [B, S, H, V]`` keeps the query dtype. Differentiable in query,
key, value, every gate and ``initial_state``.

This module also holds what the other linear-attention specs (``gla``,
``lightning_attention``) share: validation helpers, the sequential reference
:func:`linear_recurrence_reference` and the autotuning input builder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ejkernel.specs._base import (
    CHUNKED_TOLERANCES,
    builtin_op_spec,
    call_op,
    check_array,
    check_cu_seqlens,
    check_flag,
    check_qkv,
    check_softmax_scale,
    even_cu_seqlens,
    is_floating,
    synthetic_normals,
)

__all__ = [
    "SPEC",
    "check_gate",
    "check_initial_state",
    "check_linear_qkv",
    "check_packed_sequences",
    "linear_recurrence_reference",
    "linear_synthetic",
    "recurrent",
    "recurrent_reference",
    "validate_linear_common",
    "validate_recurrent",
]

OP = "recurrent"


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def linear_recurrence_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    key_gate: jax.Array | None = None,
    value_gate: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
) -> Any:
    """The sequential oracle of every linear-attention op: one ``lax.scan`` step per token.

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        key_gate: log decay of the state's K axis, broadcastable to [B, S, H, K] (a per-head
            scalar gate is given as [B, S, H, 1]); ``None`` = 0.
        value_gate: log decay of the state's V axis, [B, S, H, V]; ``None`` = 0.
        initial_state: [N, H, K, V]; ``None`` = zeros.
        softmax_scale: scales the query; ``None`` = K ** -0.5.
        reverse: run from the last token to the first.
        cu_seqlens: [N + 1] packed-sequence offsets (B == 1).
        return_state: also return the final states [N, H, K, V] (float32).

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    b, s, h, dk = query.shape
    dv = value.shape[-1]
    scale = dk**-0.5 if softmax_scale is None else softmax_scale
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v = f32(query) * scale, f32(key), f32(value)
    lk = jnp.zeros((b, s, h, dk), jnp.float32)
    if key_gate is not None:
        lk = lk + f32(key_gate)
    lv = jnp.zeros((b, s, h, dv), jnp.float32) if value_gate is None else f32(value_gate)

    t = jnp.arange(s)
    if cu_seqlens is None:
        num_seqs = b
        seq = jnp.zeros((b, s), jnp.int32)  # row-local sequence index: each row is one sequence
        inside = jnp.ones((b, s), bool)
        first = jnp.broadcast_to(t == (s - 1 if reverse else 0), (b, s))
        last = jnp.broadcast_to(t == (0 if reverse else s - 1), (b, s))
        rows = 1
    else:
        cu = cu_seqlens.astype(jnp.int32)
        num_seqs = cu.shape[0] - 1
        n = jnp.searchsorted(cu[1:], t, side="right")  # cu[n] <= t < cu[n + 1]
        inside = (t >= cu[0]) & (n < num_seqs)
        n = jnp.minimum(n, num_seqs - 1)
        starts, ends = cu[n], cu[n + 1] - 1
        first, last = (ends, starts) if reverse else (starts, ends)
        seq, inside, first, last = (x[None] for x in (n, inside, t == first, t == last))
        rows = num_seqs
    init = (
        jnp.zeros((num_seqs, h, dk, dv), jnp.float32)
        if initial_state is None
        else f32(initial_state)
    )
    init = init.reshape(b, rows, h, dk, dv)  # per batch row: the initial states of its sequences

    def one_row(q, k, v, lk, lv, seq, inside, first, last, init):
        def step(carry, x):
            state, finals = carry
            q_t, k_t, v_t, lk_t, lv_t, n, inside_t, first_t, last_t = x
            state = jnp.where(first_t, init[n], state)
            decay = jnp.exp(lk_t)[:, :, None] * jnp.exp(lv_t)[:, None, :]
            new = state * decay + k_t[:, :, None] * v_t[:, None, :]
            state = jnp.where(inside_t, new, state)
            out = jnp.where(inside_t, jnp.einsum("hk,hkv->hv", q_t, state), 0.0)
            finals = jnp.where(inside_t & last_t, finals.at[n].set(state), finals)
            return (state, finals), out

        xs = (q, k, v, lk, lv, seq, inside, first, last)
        (_, finals), out = lax.scan(step, (jnp.zeros_like(init[0]), init), xs, reverse=reverse)
        return out, finals

    out, finals = jax.vmap(one_row)(q, k, v, lk, lv, seq, inside, first, last, init)
    out = out.astype(query.dtype)
    if return_state:
        return out, finals.reshape(num_seqs, h, dk, dv)
    return out


def recurrent_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    g: jax.Array | None = None,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    **options: Any,
) -> Any:
    """``lax.scan`` over time in float32: the oracle every implementation is tested against.

    :func:`linear_recurrence_reference` with ``g`` (per head) and ``gk`` summed into the key
    gate; ``options`` are the other keyword arguments of :func:`recurrent`."""
    key_gate = None
    if g is not None:
        key_gate = g[..., None]
    if gk is not None:
        key_gate = gk if key_gate is None else key_gate + gk
    return linear_recurrence_reference(
        query, key, value, key_gate=key_gate, value_gate=gv, **options
    )


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def check_linear_qkv(op: str, q: Any, k: Any, v: Any) -> None:
    """``query``/``key`` [B, S, H, K] and ``value`` [B, S, H, V]: floating, one dtype, non-empty
    but for B (a batch of 0 is an empty call)."""
    check_qkv(op, q, k, v, letters=("[B, S, H, K]", "[B, S, H, K]", "[B, S, H, V]"))
    b, s, h, dk = q.shape
    if tuple(k.shape) != (b, s, h, dk):
        raise ValueError(
            f"{op}: `key` must be [B, S, H, K] like the query; got key.shape={tuple(k.shape)}, "
            f"query.shape={tuple(q.shape)}"
        )
    if tuple(v.shape[:3]) != (b, s, h):
        raise ValueError(
            f"{op}: `value` must be [B, S, H, V]; got value.shape={tuple(v.shape)}, "
            f"query.shape={tuple(q.shape)}"
        )
    if min(s, h, dk, v.shape[3]) == 0:
        raise ValueError(
            f"{op}: `query`/`value` must have non-empty S, H, K, V; got query.shape="
            f"{tuple(q.shape)}, value.shape={tuple(v.shape)}"
        )


def check_packed_sequences(op: str, cu: Any, query: Any) -> int:
    """``cu_seqlens`` (or None) against the query [B, S, H, K]: the number of sequences N (B
    when not packed)."""
    if cu is None:
        return int(query.shape[0])
    num_seqs = check_cu_seqlens(op, cu)
    if query.shape[0] != 1:
        raise ValueError(
            f"{op}: `cu_seqlens` packs sequences along S and needs B == 1; got "
            f"query.shape={tuple(query.shape)}"
        )
    s = int(query.shape[1])
    values = _concrete(cu)
    if values is not None and (
        values[0] < 0 or values[-1] > s or np.any(np.diff(values.astype(np.int64)) < 0)
    ):
        raise ValueError(
            f"{op}: `cu_seqlens` must lie in [0, S={s}] and never decrease; got {values.tolist()}"
        )
    return num_seqs


def _concrete(x: Any) -> np.ndarray | None:
    """The values of ``x`` when they are known now (not a tracer), else ``None``."""
    if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return None
    try:
        return np.asarray(x)
    except Exception:  # an abstract value (e.g. ShapeDtypeStruct) has no contents
        return None


def check_initial_state(op: str, init: Any, want: tuple[int, ...], *, packed: bool) -> None:
    """``initial_state`` (or None): floating [N, H, K, V] equal to ``want``."""
    if init is None:
        return
    letters = "[N, H, K, V] (N = number of cu_seqlens sequences)" if packed else "[B, H, K, V]"
    check_array(op, "initial_state", init, ndim=4, letters=letters)
    if tuple(init.shape) != want or not is_floating(init):
        raise ValueError(
            f"{op}: `initial_state` must be floating {letters}={want}; got "
            f"initial_state.shape={tuple(init.shape)}, dtype {init.dtype}"
        )


def validate_linear_common(op: str, a: dict[str, Any]) -> dict[str, Any]:
    """Check query, key, value, initial_state, cu_seqlens and the statics shared by the
    linear-attention ops; fill ``softmax_scale``. Raises ValueError/TypeError."""
    q, v, cu = a["query"], a["value"], a.get("cu_seqlens")
    check_linear_qkv(op, q, a["key"], v)
    num_seqs = check_packed_sequences(op, cu, q)
    _, _, h, dk = q.shape
    want = (num_seqs, h, dk, v.shape[3])
    check_initial_state(op, a.get("initial_state"), want, packed=cu is not None)
    a["softmax_scale"] = check_softmax_scale(op, a.get("softmax_scale"), dk)
    for flag in ("reverse", "return_state"):
        if flag in a:
            a[flag] = check_flag(op, flag, False if a[flag] is None else a[flag])
    return a


def check_gate(op: str, name: str, x: Any, want: tuple[int, ...], letters: str) -> None:
    """A log-space gate: a floating array of exactly ``want`` (OPS.md ``letters``)."""
    check_array(op, name, x, ndim=len(want), letters=letters)
    if tuple(x.shape) != want:
        raise ValueError(
            f"{op}: `{name}` must be {letters}={want}; got {name}.shape={tuple(x.shape)}"
        )
    if not is_floating(x):
        raise TypeError(
            f"{op}: `{name}` must be a floating array (log-space gate); got dtype {x.dtype}"
        )


def validate_recurrent(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of :func:`recurrent`; fill defaults. Raises ValueError/TypeError."""
    a = validate_linear_common(OP, a)
    b, s, h, dk = a["query"].shape
    dv = a["value"].shape[3]
    for name, want, letters in (
        ("g", (b, s, h), "[B, S, H]"),
        ("gk", (b, s, h, dk), "[B, S, H, K]"),
        ("gv", (b, s, h, dv), "[B, S, H, V]"),
    ):
        if a.get(name) is not None:
            check_gate(OP, name, a[name], want, letters)
    return a


# --------------------------------------------------------------------------------------------
# Autotuning inputs
# --------------------------------------------------------------------------------------------

#: Gate arguments of the linear-attention ops: synthetic values are log-sigmoids (decays ≤ 1).
GATE_NAMES = ("g", "gk", "gv")


def linear_synthetic(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Valid concrete inputs: normal q/k/v, decaying gates, evenly spread ``cu_seqlens``,
    positive ``slopes``."""
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
    adjust = {
        "cu_seqlens": even_cu_seqlens(abstract),
        **dict.fromkeys(GATE_NAMES, log_sigmoid),
        "slopes": lambda x: np.abs(x) + 0.01,
    }
    return synthetic_normals(abstract, seed, adjust)


def recurrent(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    g: jax.Array | None = None,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> Any:
    """Gated linear recurrence ``h_t = h_{t-1} ⊙ exp(g_t + gk_t)[:, None] ⊙ exp(gv_t)[None, :]
    + k_tᵀ v_t``, ``o_t = softmax_scale · q_t h_t``, on the best installed platform.

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        g: [B, S, H] per-head scalar log gate; differentiable.
        gk: [B, S, H, K] log gate of the state's K axis; differentiable.
        gv: [B, S, H, V] log gate of the state's V axis; differentiable.
        initial_state: [N, H, K, V] (N = B, or the number of ``cu_seqlens`` sequences);
            differentiable.
        softmax_scale: scales the query; default K ** -0.5.
        reverse: run from the last token to the first (token t sees tokens ≥ t).
        cu_seqlens: [N + 1] integer offsets of N sequences packed along S (B == 1); the state
            resets at each sequence start; tokens outside every sequence give zeros.
        return_state: also return the final states.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    recurrent,
    differentiable=("query", "key", "value", "g", "gk", "gv", "initial_state"),
    synthetic=linear_synthetic,
    tolerances=CHUNKED_TOLERANCES,
)
