"""kernel_delta_attention: the gated delta rule (Kimi Delta Attention, Gated DeltaNet).

Semantics every implementation follows (OPS.md vocabulary; ``H`` heads, ``K`` key/query dim,
``V`` value dim, the state ``S`` of a head is ``[K, V]``):

- With ``use_qk_l2norm`` (default), query and key are L2-normalised over ``K`` first:
  ``x / sqrt(Σ x² + 1e-6)`` (the epsilon of flash-linear-attention's ``l2norm``).
- Per token ``t`` and head: ``S_t = (I - β_t k_t k_tᵀ) diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ``
  and ``o_t = softmax_scale · q_tᵀ S_t`` (``softmax_scale`` scales the query; default
  ``K ** -0.5``; no softmax is taken). Written as a prediction error:
  ``S' = diag(exp(g_t)) S_{t-1}``, ``S_t = S' + k_t (β_t (v_t - S'ᵀ k_t))ᵀ``.
- ``g`` is a log-space decay: ``[B, S, H, K]`` decays each key channel (Kimi Delta Attention),
  ``[B, S, H]`` one scalar per head and token (Gated DeltaNet). ``g ≤ 0`` keeps the state
  bounded; ``beta`` ``[B, S, H]`` is the delta-rule step size (usually a sigmoid, in (0, 1)).
  A decay of ``-inf`` zeroes its key channel (every channel: a state reset) before the
  token's update, with finite gradients; decays are accumulated in float32.
- A NaN or inf at token t (in any input) reaches only the outputs of token t and the tokens
  after it in its sequence, as the recurrence carries it in its state.
- ``cu_seqlens`` ``[N + 1]`` packs ``N`` sequences along the token axis of a batch of one
  (flash-linear-attention's varlen convention): sequence ``n`` owns tokens
  ``[cu_seqlens[n], cu_seqlens[n + 1])``, its state starts from ``initial_state[n]`` (zeros
  when not given) and never sees another sequence. Empty sequences are allowed: their final
  state is their initial state. Tokens outside ``[cu_seqlens[0], cu_seqlens[N])`` belong to no
  sequence: their output is zero and they touch no state (as ``recurrent``).
  ``initial_state`` and the final state are then ``[N, H, K, V]``. Offsets known at
  validation are checked (``0 ≤ cu_seqlens[0]``, non-decreasing, ``cu_seqlens[N] ≤ S``);
  traced ones cannot be.
- ``return_state=True`` returns ``(out, final_state)``; the state is float32 (it is carried on
  across calls: two halves with the carried state equal one run). ``out`` keeps the query
  dtype; accumulation is float32.
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
    check_softmax_scale,
    even_cu_seqlens,
    synthetic_normals,
)
from ejkernel.specs.recurrent import (
    check_initial_state,
    check_linear_qkv,
    check_packed_sequences,
)

__all__ = [
    "SPEC",
    "kernel_delta_attention",
    "kernel_delta_attention_reference",
    "l2_normalize",
    "validate_kernel_delta_attention",
]

OP = "kernel_delta_attention"

#: Epsilon inside the L2 norm (flash-linear-attention's ``l2norm`` value).
L2NORM_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    """``x / sqrt(Σ x² + 1e-6)`` over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _sequence_ids(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, ...]:
    """Per token: its sequence, whether it starts it, ends it, lies in any sequence."""
    cu = cu_seqlens.astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, cu.shape[0] - 2)
    inside = (t >= cu[0]) & (t < cu[-1])
    return seq, t == cu[seq], t == cu[seq + 1] - 1, inside


def kernel_delta_attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    beta: jax.Array,
    g: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (a ``lax.scan`` over time) in float32: the oracle."""
    b, s, h, dk = query.shape
    dv = value.shape[-1]
    scale = dk**-0.5 if softmax_scale is None else softmax_scale
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v, bt, gt = f32(query), f32(key), f32(value), f32(beta), f32(g)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    if gt.ndim == 3:
        gt = gt[..., None]  # one decay per head: the same on every key channel

    def update(state: jax.Array, k_t: Any, v_t: Any, b_t: Any, g_t: Any) -> jax.Array:
        state = state * jnp.exp(g_t)[..., None]
        error = v_t - jnp.einsum("...k,...kv->...v", k_t, state)
        return state + k_t[..., :, None] * (b_t[..., None] * error)[..., None, :]

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    if cu_seqlens is None:
        state0 = (
            jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else f32(initial_state)
        )

        def step(state: jax.Array, xs: Any) -> tuple[jax.Array, jax.Array]:
            q_t, k_t, v_t, b_t, g_t = xs
            state = update(state, k_t, v_t, b_t, g_t)
            return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

        final, out = jax.lax.scan(step, state0, tuple(map(time_major, (q, k, v, bt, gt))))
        out = time_major(out)
    else:
        n = cu_seqlens.shape[0] - 1
        inits = (
            jnp.zeros((n, h, dk, dv), jnp.float32) if initial_state is None else f32(initial_state)
        )
        seq, starts, ends, inside = _sequence_ids(cu_seqlens, s)

        def packed_step(carry: Any, xs: Any) -> tuple[Any, jax.Array]:
            state, finals = carry
            q_t, k_t, v_t, b_t, g_t, n_t, start, end, live = xs
            state = jnp.where(start, inits[n_t], state)  # a new sequence starts from its own state
            state = jnp.where(live, update(state, k_t, v_t, b_t, g_t), state)
            finals = finals.at[n_t].set(jnp.where(end & live, state, finals[n_t]))
            out = jnp.einsum("hk,hkv->hv", q_t, state)
            return (state, finals), jnp.where(live, out, 0.0)

        xs = (q[0], k[0], v[0], bt[0], gt[0], seq, starts, ends, inside)
        (_, final), out = jax.lax.scan(packed_step, (inits[0], inits), xs)
        out = out[None]
    out = out.astype(query.dtype)
    return (out, final) if return_state else out


def validate_kernel_delta_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of the gated delta rule; fill defaults. Raises ValueError/TypeError."""
    op = OP
    q, k, v, beta, g = a["query"], a["key"], a["value"], a["beta"], a["g"]
    check_linear_qkv(op, q, k, v)
    check_array(op, "beta", beta, ndim=3, letters="[B, S, H]")
    check_array(op, "g", g, ndim=(3, 4), letters="[B, S, H, K] or [B, S, H]")
    check_floating(op, (("beta", beta), ("g", g)))
    b, s, h, dk = q.shape
    if tuple(beta.shape) != (b, s, h):
        raise ValueError(
            f"{op}: `beta` must be [B, S, H]={(b, s, h)}; got beta.shape={tuple(beta.shape)}"
        )
    if tuple(g.shape) not in ((b, s, h, dk), (b, s, h)):
        raise ValueError(
            f"{op}: `g` must be [B, S, H, K]={(b, s, h, dk)} or [B, S, H]={(b, s, h)}; "
            f"got g.shape={tuple(g.shape)}"
        )
    cu = a.get("cu_seqlens")
    num_states = check_packed_sequences(op, cu, q)
    want = (num_states, h, dk, v.shape[3])
    check_initial_state(op, a.get("initial_state"), want, packed=cu is not None)
    a["softmax_scale"] = check_softmax_scale(op, a.get("softmax_scale"), dk)
    for flag in ("use_qk_l2norm", "return_state"):
        a[flag] = check_flag(op, flag, a.get(flag))
    return a


def synthetic_kernel_delta_attention(abstract: Any, seed: int = 0) -> dict[str, Any]:
    """Valid inputs for autotuning: decays ``g ≤ 0``, ``beta`` in (0, 1), evenly cut sequences."""
    adjust = {
        "cu_seqlens": even_cu_seqlens(abstract),
        "g": lambda x: -np.logaddexp(0.0, x),  # -softplus: a decay in log space
        "beta": lambda x: 1.0 / (1.0 + np.exp(-x)),
    }
    return synthetic_normals(abstract, seed, adjust)


def kernel_delta_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    beta: jax.Array,
    g: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The gated delta rule (Kimi Delta Attention; a scalar ``g`` is Gated DeltaNet).

    ``S_t = (I - β_t k_t k_tᵀ) diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ``, ``o_t = scale · q_tᵀ S_t``.

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        beta: [B, S, H] delta-rule step sizes; differentiable.
        g: [B, S, H, K] (per key channel) or [B, S, H] (per head) log-space decays, ``≤ 0`` for
            a bounded state; differentiable.
        initial_state: [B, H, K, V] (or [N, H, K, V] with ``cu_seqlens``); zeros when ``None``.
        softmax_scale: scales the query; default K ** -0.5.
        use_qk_l2norm: L2-normalise query and key over K first.
        cu_seqlens: [N + 1] integer offsets of N sequences packed along S (B must be 1); each
            sequence starts from its own state.
        return_state: also return the final state.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        out [B, S, H, V] in the query dtype; with ``return_state``, ``(out, final_state)`` and
        final_state [B, H, K, V] (or [N, H, K, V]) float32.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    kernel_delta_attention,
    differentiable=("query", "key", "value", "beta", "g", "initial_state"),
    synthetic=synthetic_kernel_delta_attention,
    tolerances=CHUNKED_TOLERANCES,
)
