"""The streamed forward of the chunked linear-attention engine (:mod:`ejkernel_xla.ops._chunked`).

Without packed sequences or a value gate: one ``lax.scan`` over the B·N (batch row, chunk)
pairs, each step a whole chunk of one row, all heads, in cache.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel_xla.ops._chunk_numerics import finite_part, floor_gate, poison
from ejkernel_xla.ops._chunked_intra import (
    causal,
    chunk_output,
    cumulate,
    decay,
    dot,
    factorable,
    local_terms,
)
from ejkernel_xla.ops._chunked_layout import pad_axis

if TYPE_CHECKING:
    from ejkernel_xla.ops._chunked import Gates, LinearStatics

__all__ = ["stream_forward", "streamable"]


def streamable(a: dict[str, Any]) -> bool:
    """Whether :func:`stream_forward` serves a call: no packed sequences, no value gate."""
    return a.get("cu_seqlens") is None and a.get("gv") is None and a["query"].shape[1] > 0


@functools.partial(jax.jit, static_argnames=("st", "gates", "save_states"))
def stream_forward(
    a: dict[str, Any], st: LinearStatics, gates: Gates, save_states: bool
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The forward as one ``lax.scan`` over the B·N (batch row, chunk) pairs, batch-major.

    Each step takes one chunk of one batch row, all H heads, straight from the input layout
    ([B, S, H, F] viewed as [B·N, C, H, F]: no transpose of the inputs), and does the whole
    chunk while it is in cache: cumulative gates, the carried state's contribution, the
    intra-chunk matmuls and the next state (three batched matmuls over H and the [C, C]
    scores; see :func:`_stream_chunk`). The carry is the [H, K, V] state of that row only, reset
    at the row's first chunk. Nothing of size [N, ...] is built unless ``save_states`` (the
    custom-VJP forward), which also emits every chunk's start state [B, N, H, K, V]. The step
    is one chain, not independent lanes (head or batch-row groups): XLA:CPU already runs its
    elementwise work on both cores, keeps its batched matmuls on one whatever the grouping, and
    more, smaller ops make the step slower.

    Returns ``(out [B, S, H, V], final states [B, H, K, V] or None, start states or None)``.
    """
    q, k, v = (a[n].astype(jnp.float32) for n in ("query", "key", "value"))
    gk, _ = gates(a)  # floored per chunk, in the step (no extra pass over the gates)
    if gk is not None:
        gk = jnp.broadcast_to(gk, (*q.shape[:3], gk.shape[-1]))
    if st.reverse:
        q, k, v = q[:, ::-1], k[:, ::-1], v[:, ::-1]
        gk = None if gk is None else gk[:, ::-1]
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    c = st.chunk
    n = -(-s // c)
    rows = lambda x: pad_axis(x, 1, n * c).reshape(b * n, c, h, x.shape[-1])
    step_id = jnp.arange(b * n, dtype=jnp.int32)
    init = a.get("initial_state")
    init = None if init is None else init.astype(jnp.float32)

    def step(carry: Any, xs: Any) -> tuple[Any, Any]:
        state, finals = carry
        q_c, k_c, v_c, g_c, i = xs
        row, first = i // n, i % n == 0
        start = (
            jnp.zeros_like(state)
            if init is None
            else lax.dynamic_index_in_dim(init, row, axis=0, keepdims=False)
        )
        state = jnp.where(first, start, state)
        out, new = _stream_chunk(q_c, k_c, v_c, g_c, state, st)
        if finals is not None:
            keep = lax.dynamic_index_in_dim(finals, row, axis=0, keepdims=False)
            last = jnp.where(i % n == n - 1, new, keep)
            finals = lax.dynamic_update_index_in_dim(finals, last, row, axis=0)
        return (new, finals), (out, state if save_states else None)

    finals = jnp.zeros((b, h, dk, dv), jnp.float32) if st.return_state else None
    carry = (jnp.zeros((h, dk, dv), jnp.float32), finals)
    xs = (rows(q), rows(k), rows(v), None if gk is None else rows(gk), step_id)
    (_, finals), (out, h_start) = lax.scan(step, carry, xs)
    out = out.reshape(b, n * c, h, dv)[:, :s]
    out = (out[:, ::-1] if st.reverse else out).astype(a["query"].dtype)
    if h_start is not None:
        h_start = h_start.reshape(b, n, h, dk, dv)
    return out, finals, h_start


def _stream_chunk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None,
    state: jax.Array,
    st: LinearStatics,
) -> tuple[jax.Array, jax.Array]:
    """One chunk of one batch row, all heads: ``(out [C, H, V], next state [H, K, V])``.

    Inputs arrive [C, H, F] and are turned head-major ([H, C, F], in cache) for the batched
    matmuls. A per-head scalar gate (or none) takes the exact scalar form; a gate over K takes
    the factored form when this chunk's cumulative gates stay within
    ±:data:`FACTORED_RANGE` (decided per chunk with a ``lax.cond`` on chunk-sized operands),
    else the exact two-level form. The factored form is computed outside the conditional,
    which only passes its result on or runs the exact form instead: inside the branch its
    work would not overlap the rest of the step on XLA:CPU (whose elementwise fusions
    otherwise run on both cores), about 8 % slower at B 8, H 16, K = V = 128.
    """
    heads = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
    q, k, v, g = heads(q), heads(k), heads(v), heads(g)
    bk = cumulate(floor_gate(g))

    def exact() -> tuple[jax.Array, jax.Array]:
        local = local_terms(q, k, v, bk, None)
        out = chunk_output(q, k, v, bk, None, local, state, st, "exact")
        return out, decay(state, local[3], None) + local[5]

    def factored() -> tuple[jax.Array, jax.Array]:
        # One exponential per element: q̃ = q ⊙ exp(b), k̃ = k ⊙ exp(-b) (both within
        # exp(±80)); scores q̃ k̃ᵀ carry exp(b_t - b_s); the next state is
        # exp(b_last) ⊙ (S + k̃ᵀ v). Outside that range the factors overflow; the
        # conditional below then discards them.
        # Non-finite values enter the scores' product zeroed and come back as NaN from their
        # token on (a later token's exact 0 in ``scores`` times NaN would reach earlier rows).
        e = jnp.exp(bk)
        q_in, k_f = q * e, k / e
        v_in, first = finite_part(v)
        scores = jnp.where(causal(q.shape[1]), dot("mck,msk->mcs", q_in, k_f), 0.0)
        out = dot("mck,mkv->mcv", q_in, state) + dot("mcs,msv->mcv", scores, v_in)
        new = (state + dot("mck,mcv->mkv", k_f, v)) * e[:, -1, :, None]
        return poison(st.scale * out, first), new

    mode_ok = factorable(bk, None)
    if mode_ok is None:
        out, new = exact()
    else:
        fast = factored()
        out, new = lax.cond(mode_ok, lambda: fast, exact)
    return jnp.swapaxes(out, 0, 1), new
