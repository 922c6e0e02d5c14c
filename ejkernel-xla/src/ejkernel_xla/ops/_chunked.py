"""The chunked engine of the gated linear recurrence on XLA, shared by recurrent, gla,
lightning_attention and state_space_v2's backward; its pieces live in ``_chunked_layout``
(chunk layout), ``_chunked_intra`` (inside chunks) and ``_chunked_stream`` (streamed forward).

Pure JAX. The recurrence ``h_t = h_{t-1} ⊙ exp(gk_t)[:, None] ⊙ exp(gv_t)[None, :] + k_tᵀ v_t``,
``o_t = scale · q_t h_t`` (log-space gates; ``recurrent``'s ``g`` and ``gk`` add into one key
gate) is computed in chunks, the form of GLA (Yang et al., 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training", Sec. 4): parallel inside a chunk of C tokens,
recurrent across chunks.

- Gates. Inside a chunk every decay is a difference of cumulative log gates taken from the
  chunk start, ``b_t = Σ_{s ≤ t} g_s``, so nothing is ever divided by a decay. The state
  carried in is decayed by ``exp(b_t)`` for the inter-chunk output and by ``exp(b_last)`` for
  the next state; key/value rows entering the next state are weighted by
  ``exp(b_last - b_s)``. For gates ≤ 0 every exponent is ≤ 0.
- Intra-chunk output, three forms, all exact:

  * per-head scalar gate and no value gate (lightning attention, ``recurrent`` with ``g``
    only): ``(q kᵀ) ⊙ exp(b_t - b_s)`` masked to ``s ≤ t``, a [C, C] matrix per head, every
    exponent ≤ 0;
  * gates over K or V, "factored": ``exp(b_t - b_s) = exp(b_t) · exp(-b_s)``, so the chunk is
    two matmuls reusing the inter-chunk terms. Exact in float32 while every factor stays well
    inside float32's range, i.e. while every chunk's cumulative log gates stay within ±80 of
    the chunk start (:data:`FACTORED_RANGE`; GLA's ``log_sigmoid(x) / 16`` gates always do);
  * gates over K or V, "exact" (any gates): two levels, as flash-linear-attention's
    ``chunk_gla``. The chunk is cut into sub-chunks of c tokens; sub-chunk i against the tokens
    before it factors each decay through ``r_i``, the cumulative gate at its first token,
    ``exp(b_t - r_i) · exp(r_i - b_s)`` with both exponents ≤ 0 (a matmul that cannot
    overflow); inside sub-chunk i the decays are taken pairwise ([c, c, K]). Masked exponents
    are -inf before ``exp`` (never ``inf · 0``). It runs over groups of chunk rows,
    rematerialised in the backward, so its pairwise tensors stay small.

  Which of the last two runs is decided per call from the gates (``lax.cond`` around the whole
  forward, and around the whole backward: XLA copies a conditional's operands, and the raw
  inputs are the cheapest set to copy). Under ``vmap`` the condition may be batched, and then
  both run (still exact). On CPU the factored form is about 3x faster.
- Across chunks. The chunks' own state contributions ``U_n`` and decays ``D_n`` are computed
  for all chunks at once; a ``lax.scan`` over chunks then forms the chunk-start states
  ``h_n`` (the only sequential part, N = S / C steps on [B, H, K, V]), and the outputs of all
  chunks follow in parallel. Chunks are laid out chunk-major, [N, B, H, C, F], flattened to
  one row per (chunk, batch, head) for the matmuls (XLA's CPU code for broadcasts of more
  than four dimensions is several times slower).
- Forward, streamed (no ``cu_seqlens``, no value gate: gla, lightning attention, most
  ``recurrent`` calls). One ``lax.scan`` over the B·N (batch row, chunk) pairs, batch-major,
  reads each chunk of one row, all heads, straight from the [B, S, H, F] inputs and does the
  whole chunk while it is in cache (cumulative gates, ``q̃ S``, the [C, C] scores, ``k̃ᵀ v``,
  the next state), carrying only that row's [H, K, V] state; the intra-chunk form is chosen
  per chunk (a ``lax.cond`` on chunk-sized operands). The primal call emits only the outputs;
  the custom-VJP forward also emits every chunk's start state for the backward. Packed
  sequences and value gates take the all-chunks-at-once form described above.
- Cost of the forward per token and head (K, V head dims, C the chunk). Sequential scan:
  ≈ 5·K·V flops (decay, k vᵀ, q·h) as vector work, and the [K, V] state read and written
  every step, 8·K·V bytes once the B·H·K·V-float state leaves the cache. Chunked: 2·K·V
  (``q̃ S``) + 2·K·V (``k̃ᵀ v``) + 2·C·K (scores) + 2·C·V (scores · v) flops as batched
  matmuls (C = 64, K = V = 128: 98 304 against the scan's ≈ 81 920), one exponential per
  gate element, and 8·K·V / C bytes of state per token (the inputs and output, 4·(3K + V)
  bytes, are read once either way). Both do about the same flops: the chunked forward wins
  by running them as matmuls and by not streaming the state, not by doing less. On a 2-core
  CPU XLA runs batched matmuls on one core (≈ 100 GFLOP/s of 64-row blocks, against
  ≈ 300 GFLOP/s for one large 2-core matmul); see benchmarks/RESULTS.md.
- Lengths. A sequence is padded to a multiple of C with identity tokens (zero q/k/v, zero log
  gates). ``reverse`` flips the token axis (and the packed offsets) around the same engine.
- ``cu_seqlens``. The packed tokens are gathered into a chunk-aligned layout: each sequence
  starts on a fresh chunk and is padded with identity tokens to a multiple of C (at most
  ``(S + N (C - 1)) / C`` chunks, static from the shapes; offsets may be traced). Chunks then
  never straddle sequences, the state resets to the sequence's initial state at its first
  chunk, and its final state is the state after its last chunk. The heuristic shrinks C when
  sequences are short, which bounds the padding.
- Backward (custom VJP). The forward saves only its inputs and the chunk-start states
  ``h_n [N, B, H, K, V]`` (float32): autodiff through the chunked forward would also keep every
  intra-chunk intermediate. The backward first runs the state cotangent backwards over chunks,
  ``dh_n = (D_n ⊙ dh_{n+1}) + scale · (q_n ⊙ exp(b))ᵀ (do_n ⊙ exp(b^v))`` (linear, a reverse
  ``lax.scan``, cut at sequence starts where it becomes the ``initial_state`` gradient), then
  recomputes every chunk from its saved start state under ``jax.vjp`` (all chunks at once),
  which gives the q, k, v and gate gradients; the chunk layout, gate cumulation and gate
  combination are differentiated the same way.

- Numerics (:mod:`ejkernel_xla.ops._chunk_numerics`). Log gates are floored at -110 before
  they are summed: a gate of -inf (a state reset) then decays by exactly 0 like the
  recurrence, without ``-inf - -inf``. Inside a chunk the values enter the triangular products
  with non-finite entries zeroed and the outputs from a non-finite value on are NaN, and
  masked products select before multiplying, so a NaN reaches only its causal future.

Accumulation is float32 (inputs are cast once); the output keeps the query dtype and the final
state is float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel_xla.ops._chunk_numerics import floor_gates
from ejkernel_xla.ops._chunked_intra import (
    FACTORED_RANGE,
    chunk_output,
    cumulate,
    decay,
    decays,
    dot,
    local_terms,
)
from ejkernel_xla.ops._chunked_layout import Plan, layout, pad_axis
from ejkernel_xla.ops._chunked_stream import stream_forward, streamable
from ejkernel_xla.ops._tuning import backend

__all__ = [
    "Gates",
    "LinearStatics",
    "chunk_sizes",
    "factorable_call",
    "linear_attention_backward",
    "linear_attention_forward",
]

#: Default (chunk, sub-chunk) sizes per backend, for a key gate over K and for a scalar gate.
#: On CPU, 64-token chunks with 16-token sub-chunks keep the sequential scan short and the
#: pairwise [c, c, K] decays small (measured with benchmarks/bench_linear_attention.py).
_DEFAULT_CHUNKS: dict[str, tuple[int, int]] = {"cpu": (64, 16), "gpu": (64, 16), "tpu": (128, 32)}
#: Smallest chunk the heuristic picks for short packed sequences.
_MIN_CHUNK = 16


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def chunk_sizes(kwargs: Any, cfg: Any) -> tuple[int, int]:
    """``(chunk, sub_chunk)`` for a call: the config's (or the default), clamped.

    The chunk is at most the sequence length rounded up to a power of two; with
    ``cu_seqlens`` the default chunk is at most the mean packed length rounded up to a power of
    two (at least 16), so short sequences pad little. The sub-chunk divides the chunk.

    Raises:
        ValueError: a config whose sizes are not positive or whose sub-chunk does not divide
            the chunk.
    """
    query = kwargs["query"]
    seq = int(query.shape[1])
    default_chunk, default_sub = _DEFAULT_CHUNKS[backend(_DEFAULT_CHUNKS)]
    chunk = getattr(cfg, "chunk_size", None)
    sub = getattr(cfg, "sub_chunk_size", None)
    if chunk is None:
        chunk = default_chunk
        cu = kwargs.get("cu_seqlens")
        if cu is not None:
            mean = seq / max(1, int(cu.shape[0]) - 1)
            chunk = min(chunk, max(_MIN_CHUNK, _pow2_ceil(int(mean))))
    chunk = int(chunk)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk}")
    chunk = min(chunk, _pow2_ceil(seq))
    sub = int(default_sub if sub is None else sub)
    if sub < 1:
        raise ValueError(f"sub_chunk_size must be >= 1; got {sub}")
    sub = min(sub, chunk)
    if chunk % sub:
        raise ValueError(f"sub_chunk_size must divide chunk_size; got {sub} and {chunk}")
    return chunk, sub


@attrs.frozen(kw_only=True)
class LinearStatics:
    """Everything static about one call of the chunked engine (a ``jax.jit`` static argument).

    Attributes:
        scale: multiplies the query.
        reverse: run from the last token to the first.
        return_state: also return the final states.
        chunk: tokens per chunk.
        sub_chunk: tokens per sub-chunk (gates over K or V).
    """

    scale: float
    reverse: bool
    return_state: bool
    chunk: int
    sub_chunk: int

    @classmethod
    def of(
        cls,
        arrays: dict[str, Any],
        cfg: Any,
        *,
        softmax_scale: float | None,
        reverse: bool = False,
        return_state: bool = False,
    ) -> LinearStatics:
        chunk, sub = chunk_sizes(arrays, cfg)
        dk = arrays["query"].shape[-1]
        return cls(
            scale=float(dk**-0.5 if softmax_scale is None else softmax_scale),
            reverse=bool(reverse),
            return_state=bool(return_state),
            chunk=chunk,
            sub_chunk=sub,
        )


#: ``gates(arrays) -> (key_gate, value_gate)``: float32 log gates, the key gate [B, S, H, K]
#: or [B, S, H, 1] (per-head scalar), the value gate [B, S, H, V]; ``None`` when absent.
Gates = Callable[[dict[str, Any]], tuple[jax.Array | None, jax.Array | None]]

#: Inputs that may receive gradients (the rest are integer offsets).
_DIFFERENTIABLE = ("query", "key", "value", "g", "gk", "gv", "slopes", "initial_state")


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


def linear_attention_forward(
    arrays: dict[str, Any], st: LinearStatics, gates: Gates, *, residuals: bool = True
) -> tuple[Any, dict[str, Any] | None]:
    """Chunked forward: ``(out or (out, final_state), residuals)``.

    Without packed sequences or a value gate this is the streaming form
    (:func:`stream_forward`: one ``lax.scan`` step per chunk of one batch row, all heads at
    once); otherwise the all-chunks-at-once form (:func:`_forward`).

    Args:
        arrays: the op's array arguments by name (``query``, ``key``, ``value``,
            ``initial_state``, ``cu_seqlens`` and whatever ``gates`` reads).
        st: the statics.
        gates: a module-level function building the float32 log gates from ``arrays``.
        residuals: also build what the backward needs (the chunk-start states); ``False`` for
            the primal call, which then returns ``None`` residuals and does no extra work.
    """
    if streamable(arrays):
        out, final, h_start = stream_forward(arrays, st, gates, residuals)
        if h_start is not None:  # [B, N, H, K, V] -> the backward's chunk-major order
            h_start = jnp.swapaxes(h_start, 0, 1)
    else:
        out, final, h_start = _forward(arrays, st, gates)
    result = (out, final) if st.return_state else out
    return result, ({"arrays": arrays, "h_start": h_start} if residuals else None)


def linear_attention_backward(
    residuals: dict[str, Any], d_out: Any, st: LinearStatics, gates: Gates
) -> dict[str, jax.Array | None]:
    """Chunked backward from the saved chunk-start states: gradient per array argument."""
    d_o, d_final = d_out if st.return_state else (d_out, None)
    return _backward(residuals["arrays"], residuals["h_start"], d_o, d_final, st, gates)


@functools.partial(jax.jit, static_argnames=("st", "gates"))
def _forward(
    a: dict[str, Any], st: LinearStatics, gates: Gates
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """``out [B, S, H, V]``, final states [N, H, K, V] (or None) and chunk-start states
    [N, B, H, K, V]."""
    return _by_mode(factorable_call(a, st, gates), lambda mode: _forward_pass(a, st, gates, mode))


def _forward_pass(
    a: dict[str, Any], st: LinearStatics, gates: Gates, mode: str
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    plan = Plan.of(a, st)
    x = layout(a, st, gates, plan)
    q, k, v, gk, gv = (_flat(x[n]) for n in ("q", "k", "v", "gk", "gv"))
    bk, bv = cumulate(gk), cumulate(gv)
    local = local_terms(q, k, v, bk, bv)
    dk, dv, u = local[3:]
    h_start = _scan_states(dk, dv, u, x["init"], plan)
    h = h_start.reshape(-1, *h_start.shape[3:])
    o = chunk_output(q, k, v, bk, bv, local, h, st, mode)
    out = plan.from_chunks(o.reshape(*x["v"].shape)).astype(a["query"].dtype)
    final = None
    if st.return_state:
        h_end = (decay(h, dk, dv) + u).reshape(h_start.shape)
        final = plan.rows_to_final(_final_rows(h_end, x["init"], plan))
    return out, final, h_start


@functools.partial(jax.jit, static_argnames=("st", "gates"))
def _backward(
    a: dict[str, Any],
    h_start: jax.Array,
    d_out: jax.Array,
    d_final: jax.Array | None,
    st: LinearStatics,
    gates: Gates,
) -> dict[str, jax.Array | None]:
    return _by_mode(
        factorable_call(a, st, gates),
        lambda mode: _backward_pass(a, h_start, d_out, d_final, st, gates, mode),
    )


def _backward_pass(
    a: dict[str, Any],
    h_start: jax.Array,
    d_out: jax.Array,
    d_final: jax.Array | None,
    st: LinearStatics,
    gates: Gates,
    mode: str,
) -> dict[str, jax.Array | None]:
    plan = Plan.of(a, st)
    diff = {n: a[n] for n in _DIFFERENTIABLE if a.get(n) is not None}
    rest = {n: x for n, x in a.items() if n not in diff}
    x, layout_vjp = jax.vjp(lambda d: layout({**rest, **d}, st, gates, plan), diff)
    q, k, v, gk, gv = (_flat(x[n]) for n in ("q", "k", "v", "gk", "gv"))
    do = _flat(plan.to_chunks(d_out.astype(jnp.float32)))
    bk, bv = cumulate(gk), cumulate(gv)
    dk, dv = decays(bk), decays(bv)
    # What each chunk's output sends back to its start state: scale · q̃ᵀ (do ⊙ exp(b^v)).
    q_in = q if bk is None else q * jnp.exp(bk)
    do_in = do if bv is None else do * jnp.exp(bv)
    p = st.scale * dot("mck,mcv->mkv", q_in, do_in)
    rows = x["init"].shape[1]
    if d_final is None:
        d_rows = jnp.zeros_like(x["init"])
    else:
        (d_rows,) = jax.linear_transpose(plan.rows_to_final, x["init"])(d_final.astype(jnp.float32))
    dh_end, dh_start = _scan_state_cotangents(dk, dv, p, d_rows, plan)
    # A sequence's initial state gets the cotangent of its first chunk's start state, or its
    # final-state cotangent when it is empty.
    first = jnp.take(dh_start, plan.first_chunk, axis=0).transpose(1, 0, 2, 3, 4)
    d_init = jnp.where(plan.nonempty[None, :, None, None, None], first, d_rows[:, : rows - 1])
    d_init = jnp.concatenate([d_init, jnp.zeros_like(d_rows[:, rows - 1 :])], axis=1)
    h = h_start.reshape(-1, *h_start.shape[3:])

    # Every chunk recomputed from its saved start state, differentiated at once.
    def chunks(q: Any, k: Any, v: Any, gk: Any, gv: Any) -> tuple[jax.Array, jax.Array]:
        bk, bv = cumulate(gk), cumulate(gv)
        local = local_terms(q, k, v, bk, bv)
        dk, dv, u = local[3:]
        return chunk_output(q, k, v, bk, bv, local, h, st, mode), decay(h, dk, dv) + u

    _, chunks_vjp = jax.vjp(chunks, q, k, v, gk, gv)
    dq, dk_, dv_, dgk, dgv = chunks_vjp((do, dh_end.reshape(h.shape)))
    unflat = lambda g, like: None if g is None else g.reshape(like.shape)
    (grads,) = layout_vjp(
        {
            "q": unflat(dq, x["q"]),
            "k": unflat(dk_, x["k"]),
            "v": unflat(dv_, x["v"]),
            "gk": unflat(dgk, x["gk"]),
            "gv": unflat(dgv, x["gv"]),
            "init": d_init,
        }
    )
    return {n: grads.get(n) for n in _DIFFERENTIABLE if n in a}


def _flat(x: jax.Array | None) -> jax.Array | None:
    """[N, B, H, C, F] -> [N·B·H, C, F] (chunk-major: one row per chunk and head)."""
    return None if x is None else x.reshape(-1, *x.shape[3:])


def _by_mode(pred: Any, fn: Callable[[str], Any]) -> Any:
    """``fn("factored")`` when ``pred`` holds, else ``fn("exact")``; one branch runs.

    The branch is taken around a whole pass: XLA copies a conditional's operands, and the raw
    inputs are the smallest set to copy.
    """
    if pred is None:
        return fn("exact")
    return lax.cond(pred, lambda: fn("factored"), lambda: fn("exact"))


def factorable_call(a: dict[str, Any], st: LinearStatics, gates: Gates) -> jax.Array | None:
    """Whether the factored form is safe for a call (a traced bool; ``None``: no gate over K
    or V), from its gates alone, before any layout.

    Every chunk's spread of cumulative log gates (chunk start included) is at most the sum of
    ``|g|`` over its tokens, equal to it for gates ≤ 0. Without ``cu_seqlens`` the chunks are
    aligned windows of the (possibly flipped) token axis; with it a chunk holds at most C
    consecutive tokens of the packed axis, so every window of C tokens is checked (a bound,
    never an underestimate).
    """
    gk, gv = floor_gates(gates(a))
    if gv is None and (gk is None or gk.shape[-1] == 1):
        return None
    c = st.chunk
    worst = []
    for g in (gk, gv):
        if g is None:
            continue
        g = jnp.abs(g[:, ::-1] if st.reverse else g)
        if a.get("cu_seqlens") is None:
            n = -(-g.shape[1] // c)
            sums = pad_axis(g, 1, n * c).reshape(g.shape[0], n, c, *g.shape[2:]).sum(axis=2)
        else:
            w = min(c, g.shape[1])
            before = jnp.cumsum(jnp.pad(g, [(0, 0), (1, 0)] + [(0, 0)] * (g.ndim - 2)), axis=1)
            sums = before[:, w:] - before[:, :-w]  # every window of w consecutive tokens
        worst.append(jnp.max(sums))
    return functools.reduce(jnp.maximum, worst) <= FACTORED_RANGE


# --------------------------------------------------------------------------------------------
# Across chunks
# --------------------------------------------------------------------------------------------


def _scan_states(
    dk: jax.Array | None, dv: jax.Array | None, u: jax.Array, init: jax.Array, plan: Plan
) -> jax.Array:
    """Chunk-start states [N, B, H, K, V]: ``h_{n+1} = D_n ⊙ h_n + U_n``, reset at starts."""
    rows = init[:, 0].shape

    def step(h: jax.Array, xs: Any) -> tuple[jax.Array, jax.Array]:
        dk_n, dv_n, u_n, reset, sid = xs
        h = jnp.where(reset, lax.dynamic_index_in_dim(init, sid, axis=1, keepdims=False), h)
        return decay(h, dk_n, dv_n) + u_n, h

    xs = (_per_chunk(dk, rows), _per_chunk(dv, rows), _per_chunk(u, rows), plan.reset, plan.sid)
    _, h_start = lax.scan(step, jnp.zeros(rows, jnp.float32), xs)
    return h_start


def _scan_state_cotangents(
    dk: jax.Array | None, dv: jax.Array | None, p: jax.Array, d_rows: jax.Array, plan: Plan
) -> tuple[jax.Array, jax.Array]:
    """Cotangents of every chunk's end and start state, [N, B, H, K, V] each (reverse scan)."""
    rows = d_rows[:, 0].shape

    def step(c: jax.Array, xs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        dk_n, dv_n, p_n, reset, last, sid = xs
        final = lax.dynamic_index_in_dim(d_rows, sid, axis=1, keepdims=False)
        dh_end = c + jnp.where(last, final, 0.0)
        dh_start = decay(dh_end, dk_n, dv_n) + p_n
        return jnp.where(reset, 0.0, dh_start), (dh_end, dh_start)

    xs = (
        _per_chunk(dk, rows),
        _per_chunk(dv, rows),
        _per_chunk(p, rows),
        plan.reset,
        plan.last,
        plan.sid,
    )
    _, (dh_end, dh_start) = lax.scan(step, jnp.zeros(rows, jnp.float32), xs, reverse=True)
    return dh_end, dh_start


def _per_chunk(x: jax.Array | None, rows: tuple[int, ...]) -> jax.Array | None:
    """[N·B·H, F...] -> [N, B, H, F...] (scanned over N)."""
    if x is None:
        return None
    return x.reshape(-1, rows[0], rows[1], *x.shape[1:])


def _final_rows(h_end: jax.Array, init: jax.Array, plan: Plan) -> jax.Array:
    """[B, R + 1, H, K, V]: each sequence's last end state, or its initial state if empty."""
    last = jnp.take(h_end, plan.last_chunk, axis=0).transpose(1, 0, 2, 3, 4)
    rows = init.shape[1]
    finals = jnp.where(plan.nonempty[None, :, None, None, None], last, init[:, : rows - 1])
    return jnp.concatenate([finals, init[:, rows - 1 :]], axis=1)
