"""recurrent on XLA, and the chunked engine shared by gla and lightning_attention.

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
    the chunk start (:data:`_FACTORED_RANGE`; GLA's ``log_sigmoid(x) / 16`` gates always do);
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

Accumulation is float32 (inputs are cast once); the output keeps the query dtype and the final
state is float32. It declines nothing (no ``supports``): every valid call runs on every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.plugins import defvjp

__all__ = [
    "LinearStatics",
    "RecurrentConfig",
    "chunk_sizes",
    "config_space",
    "heuristic",
    "linear_attention_backward",
    "linear_attention_forward",
    "recurrent_xla",
]

#: Default (chunk, sub-chunk) sizes per backend, for a key gate over K and for a scalar gate.
#: On CPU, 64-token chunks with 16-token sub-chunks keep the sequential scan short and the
#: pairwise [c, c, K] decays small (measured with benchmarks/bench_linear_attention.py).
_DEFAULT_CHUNKS: dict[str, tuple[int, int]] = {"cpu": (64, 16), "gpu": (64, 16), "tpu": (128, 32)}
#: (chunk, sub-chunk) pairs :func:`config_space` offers.
_TUNING_CHUNKS: tuple[tuple[int, int], ...] = (
    (32, 8),
    (32, 16),
    (64, 16),
    (64, 32),
    (128, 16),
    (128, 32),
)
#: Smallest chunk the heuristic picks for short packed sequences.
_MIN_CHUNK = 16


@attrs.frozen(kw_only=True)
class RecurrentConfig:
    """Tunables of the chunked XLA recurrence (also used by gla and lightning_attention).

    Attributes:
        chunk_size: tokens per chunk (parallel inside, recurrent across); ``None`` takes the
            backend's default. Clamped to the sequence length rounded up to a power of two.
        sub_chunk_size: tokens per sub-chunk for gates over K or V; must divide
            ``chunk_size``; ``None`` takes the default (clamped to the chunk).
    """

    chunk_size: int | None = None
    sub_chunk_size: int | None = None


def heuristic(inv: Any) -> RecurrentConfig:
    """The backend's default chunk sizes, smaller for short sequences or short packed ones."""
    chunk, sub = chunk_sizes(inv.kwargs, None)
    return RecurrentConfig(chunk_size=chunk, sub_chunk_size=sub)


def config_space(inv: Any) -> list[RecurrentConfig]:
    """The heuristic's config, then a few (chunk, sub-chunk) pairs, clamped and deduplicated."""
    configs = [heuristic(inv)]
    for chunk, sub in _TUNING_CHUNKS:
        size = chunk_sizes(inv.kwargs, RecurrentConfig(chunk_size=chunk, sub_chunk_size=sub))
        cfg = RecurrentConfig(chunk_size=size[0], sub_chunk_size=size[1])
        if cfg not in configs:
            configs.append(cfg)
    return configs


def recurrent_xla(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array | None = None,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: RecurrentConfig | None = None,
) -> Any:
    """Gated linear recurrence, chunked (arguments as validated by the core spec).

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        g: [B, S, H] scalar log gate per head, or ``None``.
        gk: [B, S, H, K] log gate of the K axis, or ``None``.
        gv: [B, S, H, V] log gate of the V axis, or ``None``.
        initial_state: [N, H, K, V] or ``None`` (zeros).
        softmax_scale: scales the query; ``None`` means K ** -0.5.
        reverse: run from the last token to the first.
        cu_seqlens: [N + 1] packed-sequence offsets (B == 1), or ``None``.
        return_state: also return the final states [N, H, K, V] (float32).
        cfg: chunk sizes; ``None`` takes the defaults.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    out, _ = _recurrent_fwd(
        query=query,
        key=key,
        value=value,
        g=g,
        gk=gk,
        gv=gv,
        initial_state=initial_state,
        softmax_scale=softmax_scale,
        reverse=reverse,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
        cfg=cfg,
        residuals=False,
    )
    return out


def _recurrent_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array | None = None,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: RecurrentConfig | None = None,
    residuals: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`recurrent_xla`: ``(out, residuals)``; residuals are the inputs and the
    chunk-start states."""
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "g": g,
        "gk": gk,
        "gv": gv,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    st = LinearStatics.of(
        arrays, cfg, softmax_scale=softmax_scale, reverse=reverse, return_state=return_state
    )
    return linear_attention_forward(arrays, st, _recurrent_gates, residuals=residuals)


def _recurrent_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: RecurrentConfig | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    return_state: bool = False,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`recurrent_xla`: gradients of q, k, v, g, gk, gv and initial_state."""
    st = LinearStatics.of(
        residuals["arrays"],
        cfg,
        softmax_scale=softmax_scale,
        reverse=reverse,
        return_state=return_state,
    )
    return linear_attention_backward(residuals, d_out, st, _recurrent_gates)


defvjp(recurrent_xla, _recurrent_fwd, _recurrent_bwd)


def _recurrent_gates(a: dict[str, Any]) -> tuple[jax.Array | None, jax.Array | None]:
    """``g`` and ``gk`` add into one key gate ([B, S, H, 1] when only ``g`` is given)."""
    g, gk, gv = a["g"], a["gk"], a["gv"]
    key_gate = None
    if g is not None:
        key_gate = g.astype(jnp.float32)[..., None]
    if gk is not None:
        key_gate = gk.astype(jnp.float32) if key_gate is None else key_gate + gk.astype(jnp.float32)
    return key_gate, None if gv is None else gv.astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# Configuration helpers (shared with gla and lightning_attention)
# --------------------------------------------------------------------------------------------


def _backend() -> str:
    name = jax.default_backend().lower()
    name = "gpu" if name in ("cuda", "rocm") else name
    return name if name in _DEFAULT_CHUNKS else "cpu"


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
    default_chunk, default_sub = _DEFAULT_CHUNKS[_backend()]
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
    (:func:`_stream_forward`: one ``lax.scan`` step per chunk of one batch row, all heads at
    once); otherwise the all-chunks-at-once form (:func:`_forward`).

    Args:
        arrays: the op's array arguments by name (``query``, ``key``, ``value``,
            ``initial_state``, ``cu_seqlens`` and whatever ``gates`` reads).
        st: the statics.
        gates: a module-level function building the float32 log gates from ``arrays``.
        residuals: also build what the backward needs (the chunk-start states); ``False`` for
            the primal call, which then returns ``None`` residuals and does no extra work.
    """
    if _streamable(arrays):
        out, final, h_start = _stream_forward(arrays, st, gates, residuals)
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
    return _by_mode(_factorable_call(a, st, gates), lambda mode: _forward_pass(a, st, gates, mode))


def _forward_pass(
    a: dict[str, Any], st: LinearStatics, gates: Gates, mode: str
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    plan = _Plan.of(a, st)
    x = _layout(a, st, gates, plan)
    q, k, v, gk, gv = (_flat(x[n]) for n in ("q", "k", "v", "gk", "gv"))
    bk, bv = _cumulate(gk), _cumulate(gv)
    local = _local_terms(q, k, v, bk, bv)
    dk, dv, u = local[3:]
    h_start = _scan_states(dk, dv, u, x["init"], plan)
    h = h_start.reshape(-1, *h_start.shape[3:])
    o = _chunk_output(q, k, v, bk, bv, local, h, st, mode)
    out = plan.from_chunks(o.reshape(*x["v"].shape)).astype(a["query"].dtype)
    final = None
    if st.return_state:
        h_end = (_decay(h, dk, dv) + u).reshape(h_start.shape)
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
        _factorable_call(a, st, gates),
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
    plan = _Plan.of(a, st)
    diff = {n: a[n] for n in _DIFFERENTIABLE if a.get(n) is not None}
    rest = {n: x for n, x in a.items() if n not in diff}
    x, layout_vjp = jax.vjp(lambda d: _layout({**rest, **d}, st, gates, plan), diff)
    q, k, v, gk, gv = (_flat(x[n]) for n in ("q", "k", "v", "gk", "gv"))
    do = _flat(plan.to_chunks(d_out.astype(jnp.float32)))
    bk, bv = _cumulate(gk), _cumulate(gv)
    dk, dv = _decays(bk), _decays(bv)
    # What each chunk's output sends back to its start state: scale · q̃ᵀ (do ⊙ exp(b^v)).
    q_in = q if bk is None else q * jnp.exp(bk)
    do_in = do if bv is None else do * jnp.exp(bv)
    p = st.scale * _dot("mck,mcv->mkv", q_in, do_in)
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
        bk, bv = _cumulate(gk), _cumulate(gv)
        local = _local_terms(q, k, v, bk, bv)
        dk, dv, u = local[3:]
        return _chunk_output(q, k, v, bk, bv, local, h, st, mode), _decay(h, dk, dv) + u

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


def _streamable(a: dict[str, Any]) -> bool:
    """Whether :func:`_stream_forward` serves a call: no packed sequences, no value gate."""
    return a.get("cu_seqlens") is None and a.get("gv") is None and a["query"].shape[1] > 0


@functools.partial(jax.jit, static_argnames=("st", "gates", "save_states"))
def _stream_forward(
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
    gk, _ = gates(a)
    if gk is not None:
        gk = jnp.broadcast_to(gk, (*q.shape[:3], gk.shape[-1]))
    if st.reverse:
        q, k, v = q[:, ::-1], k[:, ::-1], v[:, ::-1]
        gk = None if gk is None else gk[:, ::-1]
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    c = st.chunk
    n = -(-s // c)
    rows = lambda x: _pad_axis(x, 1, n * c).reshape(b * n, c, h, x.shape[-1])
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
    ±:data:`_FACTORED_RANGE` (decided per chunk with a ``lax.cond`` on chunk-sized operands),
    else the exact two-level form. The factored form is computed outside the conditional,
    which only passes its result on or runs the exact form instead: inside the branch its
    work would not overlap the rest of the step on XLA:CPU (whose elementwise fusions
    otherwise run on both cores), about 8 % slower at B 8, H 16, K = V = 128.
    """
    heads = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
    q, k, v, g = heads(q), heads(k), heads(v), heads(g)
    bk = _cumulate(g)

    def exact() -> tuple[jax.Array, jax.Array]:
        local = _local_terms(q, k, v, bk, None)
        out = _chunk_output(q, k, v, bk, None, local, state, st, "exact")
        return out, _decay(state, local[3], None) + local[5]

    def factored() -> tuple[jax.Array, jax.Array]:
        # One exponential per element: q̃ = q ⊙ exp(b), k̃ = k ⊙ exp(-b) (both within
        # exp(±80)); scores q̃ k̃ᵀ carry exp(b_t - b_s); the next state is
        # exp(b_last) ⊙ (S + k̃ᵀ v). Outside that range the factors overflow; the
        # conditional below then discards them.
        e = jnp.exp(bk)
        q_in, k_f = q * e, k / e
        scores = jnp.where(_causal(q.shape[1]), _dot("mck,msk->mcs", q_in, k_f), 0.0)
        out = _dot("mck,mkv->mcv", q_in, state) + _dot("mcs,msv->mcv", scores, v)
        new = (state + _dot("mck,mcv->mkv", k_f, v)) * e[:, -1, :, None]
        return st.scale * out, new

    mode_ok = _factorable(bk, None)
    if mode_ok is None:
        out, new = exact()
    else:
        fast = factored()
        out, new = lax.cond(mode_ok, lambda: fast, exact)
    return jnp.swapaxes(out, 0, 1), new


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


def _factorable_call(a: dict[str, Any], st: LinearStatics, gates: Gates) -> jax.Array | None:
    """Whether the factored form is safe for a call (a traced bool; ``None``: no gate over K
    or V), from its gates alone, before any layout.

    Every chunk's spread of cumulative log gates (chunk start included) is at most the sum of
    ``|g|`` over its tokens, equal to it for gates ≤ 0. Without ``cu_seqlens`` the chunks are
    aligned windows of the (possibly flipped) token axis; with it a chunk holds at most C
    consecutive tokens of the packed axis, so every window of C tokens is checked (a bound,
    never an underestimate).
    """
    gk, gv = gates(a)
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
            sums = _pad_axis(g, 1, n * c).reshape(g.shape[0], n, c, *g.shape[2:]).sum(axis=2)
        else:
            w = min(c, g.shape[1])
            before = jnp.cumsum(jnp.pad(g, [(0, 0), (1, 0)] + [(0, 0)] * (g.ndim - 2)), axis=1)
            sums = before[:, w:] - before[:, :-w]  # every window of w consecutive tokens
        worst.append(jnp.max(sums))
    return functools.reduce(jnp.maximum, worst) <= _FACTORED_RANGE


# --------------------------------------------------------------------------------------------
# Chunk layout
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Plan:
    """How tokens map to chunks, and where sequences start and end (integer arrays).

    Without ``cu_seqlens`` each batch row is one sequence of ``N = ceil(S / C)`` chunks. With
    it, the (single) row's sequences are laid out chunk-aligned: sequence m owns chunks
    ``[chunk_off[m], chunk_off[m + 1])``; chunks past the last sequence are padding.

    Attributes:
        seq: S.
        chunk: C.
        num_chunks: N (static).
        reverse: tokens are flipped before the layout.
        slot_token / slot_valid: [N·C] source token of each slot (packed layout only).
        token_slot / token_valid: [S] slot of each token (packed layout only).
        sid: [N] sequence (state row) of each chunk; padding chunks use the last, zero row.
        reset: [N] the chunk starts its sequence (the state is reset to its initial state).
        last: [N] the chunk ends its sequence (its end state is the final state).
        first_chunk / nonempty: [R] first chunk of each sequence, and whether it has one.
        last_chunk: [R] last chunk of each sequence.
    """

    seq: int
    chunk: int
    num_chunks: int
    reverse: bool
    packed: bool
    slot_token: Any = None
    slot_valid: Any = None
    token_slot: Any = None
    token_valid: Any = None
    sid: Any = None
    reset: Any = None
    last: Any = None
    first_chunk: Any = None
    last_chunk: Any = None
    nonempty: Any = None

    @classmethod
    def of(cls, a: dict[str, Any], st: LinearStatics) -> _Plan:
        s, c = a["query"].shape[1], st.chunk
        cu = a.get("cu_seqlens")
        if cu is None:
            n = -(-s // c)
            idx = jnp.arange(n)
            return cls(
                seq=s,
                chunk=c,
                num_chunks=n,
                reverse=st.reverse,
                packed=False,
                sid=jnp.zeros(n, jnp.int32),
                reset=idx == 0,
                last=idx == n - 1,
                first_chunk=jnp.zeros(1, jnp.int32),
                last_chunk=jnp.full(1, n - 1, jnp.int32),
                nonempty=jnp.ones(1, bool),
            )
        cu = cu.astype(jnp.int32)
        if st.reverse:
            cu = s - cu[::-1]
        m = cu.shape[0] - 1
        n = max(1, (s + m * (c - 1)) // c)
        lens = jnp.maximum(cu[1:] - cu[:-1], 0)
        counts = (lens + c - 1) // c
        off = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
        chunk_idx = jnp.arange(n, dtype=jnp.int32)
        sid = jnp.searchsorted(off[1:], chunk_idx, side="right").astype(jnp.int32)  # m = padding
        real = chunk_idx < off[m]
        sid_c = jnp.minimum(sid, m - 1)
        reset = ~real | (chunk_idx == off[sid_c])
        last = ~real | (chunk_idx == off[sid_c + 1] - 1)
        slot = jnp.arange(n * c, dtype=jnp.int32)
        slot_chunk = slot // c
        slot_sid = sid_c[slot_chunk]
        offset = (slot_chunk - off[slot_sid]) * c + slot % c
        slot_valid = real[slot_chunk] & (offset < lens[slot_sid])
        slot_token = jnp.clip(cu[slot_sid] + offset, 0, s - 1)
        tok = jnp.arange(s, dtype=jnp.int32)
        tok_sid = jnp.searchsorted(cu[1:], tok, side="right").astype(jnp.int32)
        token_valid = (tok >= cu[0]) & (tok_sid < m)
        tok_sid = jnp.minimum(tok_sid, m - 1)
        token_slot = jnp.clip(off[tok_sid] * c + tok - cu[tok_sid], 0, n * c - 1)
        return cls(
            seq=s,
            chunk=c,
            num_chunks=n,
            reverse=st.reverse,
            packed=True,
            slot_token=slot_token,
            slot_valid=slot_valid,
            token_slot=token_slot,
            token_valid=token_valid,
            sid=jnp.where(real, sid_c, m),
            reset=reset,
            last=last,
            first_chunk=jnp.minimum(off[:-1], n - 1),
            last_chunk=jnp.clip(off[1:] - 1, 0, n - 1),
            nonempty=counts > 0,
        )

    def to_chunks(self, x: jax.Array) -> jax.Array:
        """[B, S, H, F] -> [N, B, H, C, F], padded with zeros (identity tokens)."""
        if self.reverse:
            x = x[:, ::-1]
        b, _, h, f = x.shape
        if not self.packed:
            x = _pad_axis(x, 1, self.num_chunks * self.chunk)
            return x.reshape(b, self.num_chunks, self.chunk, h, f).transpose(1, 0, 3, 2, 4)
        x = jnp.take(x[0], self.slot_token, axis=0)
        x = jnp.where(self.slot_valid[:, None, None], x, 0.0)
        return x.reshape(self.num_chunks, 1, self.chunk, h, f).transpose(0, 1, 3, 2, 4)

    def from_chunks(self, x: jax.Array) -> jax.Array:
        """[N, B, H, C, F] -> [B, S, H, F]; tokens outside every sequence are zero."""
        n, b, h, c, f = x.shape
        x = x.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, f)
        if not self.packed:
            x = x[:, : self.seq]
        else:
            x = jnp.take(x[0], self.token_slot, axis=0)
            x = jnp.where(self.token_valid[:, None, None], x, 0.0)[None]
        return x[:, ::-1] if self.reverse else x

    def state_rows(self, init: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
        """[N, H, K, V] initial states -> [B, R + 1, H, K, V] rows (R sequences per batch row,
        then a zero row for padding chunks)."""
        b = shape[0]
        rows = 1 if not self.packed else self.first_chunk.shape[0]
        per_row = (b, rows, *shape[1:])
        x = jnp.zeros(per_row, jnp.float32) if init is None else init.astype(jnp.float32)
        if self.packed and self.reverse:
            x = x[::-1]
        x = x.reshape(per_row)
        return jnp.concatenate([x, jnp.zeros((b, 1, *shape[1:]), jnp.float32)], axis=1)

    def rows_to_final(self, rows: jax.Array) -> jax.Array:
        """[B, R + 1, H, K, V] -> the op's final states [N, H, K, V] (linear)."""
        x = rows[:, :-1].reshape(-1, *rows.shape[2:])
        return x[::-1] if self.packed and self.reverse else x


def _layout(a: dict[str, Any], st: LinearStatics, gates: Gates, plan: _Plan) -> dict[str, Any]:
    """Float32 chunked q, k, v [N, B, H, C, F], log gates and initial-state rows."""
    del st
    q, k, v = (a[n].astype(jnp.float32) for n in ("query", "key", "value"))
    gk, gv = gates(a)
    if gk is not None:
        gk = jnp.broadcast_to(gk, (*q.shape[:3], gk.shape[-1]))
    b, _, h, dk = q.shape
    return {
        "q": plan.to_chunks(q),
        "k": plan.to_chunks(k),
        "v": plan.to_chunks(v),
        "gk": None if gk is None else plan.to_chunks(gk),
        "gv": None if gv is None else plan.to_chunks(gv),
        "init": plan.state_rows(a.get("initial_state"), (b, h, dk, v.shape[-1])),
    }


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


# --------------------------------------------------------------------------------------------
# Across chunks
# --------------------------------------------------------------------------------------------


def _scan_states(
    dk: jax.Array | None, dv: jax.Array | None, u: jax.Array, init: jax.Array, plan: _Plan
) -> jax.Array:
    """Chunk-start states [N, B, H, K, V]: ``h_{n+1} = D_n ⊙ h_n + U_n``, reset at starts."""
    rows = init[:, 0].shape

    def step(h: jax.Array, xs: Any) -> tuple[jax.Array, jax.Array]:
        dk_n, dv_n, u_n, reset, sid = xs
        h = jnp.where(reset, lax.dynamic_index_in_dim(init, sid, axis=1, keepdims=False), h)
        return _decay(h, dk_n, dv_n) + u_n, h

    xs = (_per_chunk(dk, rows), _per_chunk(dv, rows), _per_chunk(u, rows), plan.reset, plan.sid)
    _, h_start = lax.scan(step, jnp.zeros(rows, jnp.float32), xs)
    return h_start


def _scan_state_cotangents(
    dk: jax.Array | None, dv: jax.Array | None, p: jax.Array, d_rows: jax.Array, plan: _Plan
) -> tuple[jax.Array, jax.Array]:
    """Cotangents of every chunk's end and start state, [N, B, H, K, V] each (reverse scan)."""
    rows = d_rows[:, 0].shape

    def step(c: jax.Array, xs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        dk_n, dv_n, p_n, reset, last, sid = xs
        final = lax.dynamic_index_in_dim(d_rows, sid, axis=1, keepdims=False)
        dh_end = c + jnp.where(last, final, 0.0)
        dh_start = _decay(dh_end, dk_n, dv_n) + p_n
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


def _final_rows(h_end: jax.Array, init: jax.Array, plan: _Plan) -> jax.Array:
    """[B, R + 1, H, K, V]: each sequence's last end state, or its initial state if empty."""
    last = jnp.take(h_end, plan.last_chunk, axis=0).transpose(1, 0, 2, 3, 4)
    rows = init.shape[1]
    finals = jnp.where(plan.nonempty[None, :, None, None, None], last, init[:, : rows - 1])
    return jnp.concatenate([finals, init[:, rows - 1 :]], axis=1)


# --------------------------------------------------------------------------------------------
# Inside chunks: every array is [M, C, F], one row per (chunk, batch, head)
# --------------------------------------------------------------------------------------------

#: Largest range of the cumulative log gates inside a chunk (the chunk start, 0, included) for
#: which the factored form runs: its factors stay within exp(±80) and so do the products of any
#: pair, short of float32's overflow (exp(88.7)) and of its subnormals (exp(-87.3)).
_FACTORED_RANGE = 80.0
#: Tokens per block of the two-level cumulative sum of the gates.
_CUMSUM_BLOCK = 8
#: Pairwise-decay elements (float32) the exact path materialises per group of chunk rows.
_EXACT_GROUP_ELEMENTS = 1 << 18


def _cumulate(g: jax.Array | None) -> jax.Array | None:
    """Cumulative log gates from the chunk start (inclusive), [M, C, F].

    Two levels of XLA's cumulative sum (inside blocks of 8 tokens, then across blocks), which
    is several times faster on CPU than one over the chunk and as accurate: every sum is the
    previous one plus one gate, rounded once, so ``b_t - b_s`` for nearby tokens keeps its
    digits even for large gates (a tree-shaped scan loses them).
    """
    if g is None:
        return None
    m, c, f = g.shape
    if c % _CUMSUM_BLOCK or c <= _CUMSUM_BLOCK:
        return jnp.cumsum(g, axis=1)
    inside = jnp.cumsum(g.reshape(m, c // _CUMSUM_BLOCK, _CUMSUM_BLOCK, f), axis=2)
    totals = jnp.cumsum(inside[:, :, -1], axis=1)
    before = jnp.concatenate([jnp.zeros_like(totals[:, :1]), totals[:, :-1]], axis=1)
    return (before[:, :, None] + inside).reshape(m, c, f)


def _decays(b: jax.Array | None) -> jax.Array | None:
    """Whole-chunk decay ``exp(b_last)``, [M, F]."""
    return None if b is None else jnp.exp(b[:, -1])


def _decay(h: jax.Array, dk: jax.Array | None, dv: jax.Array | None) -> jax.Array:
    """``h ⊙ dk[:, None] ⊙ dv[None, :]`` for states [..., K, V] (absent factors are 1)."""
    if dk is not None:
        h = h * dk[..., :, None]
    if dv is not None:
        h = h * dv[..., None, :]
    return h


def _local_terms(
    q: jax.Array, k: jax.Array, v: jax.Array, bk: jax.Array | None, bv: jax.Array | None
) -> tuple[Any, ...]:
    """What every chunk computes on its own, all with non-positive exponents for gates ≤ 0:

    ``q ⊙ exp(b)`` (reads the carried state), ``k ⊙ exp(b_last - b)`` and
    ``v ⊙ exp(b^v_last - b^v)`` (enter the next state), the whole-chunk decays [M, F] and the
    chunk's own state ``U = Σ_s (k_s ⊙ exp(b_last - b_s))ᵀ (v_s ⊙ exp(b^v_last - b^v_s))``
    [M, K, V].
    """
    if bk is not None:
        q = q * jnp.exp(bk)
        k = k * jnp.exp(bk[:, -1:] - bk)
    if bv is not None:
        v = v * jnp.exp(bv[:, -1:] - bv)
    return q, k, v, _decays(bk), _decays(bv), _dot("mck,mcv->mkv", k, v)


def _factorable(bk: jax.Array | None, bv: jax.Array | None) -> jax.Array | None:
    """Whether every chunk's cumulative gates stay within ±:data:`_FACTORED_RANGE` of each
    other and of the chunk start (a traced bool); ``None`` when there is nothing to choose
    (no gate over K or V)."""
    if bv is None and (bk is None or bk.shape[-1] == 1):
        return None  # the scalar path is exact and cheap
    spread = lambda b: jnp.max(
        jnp.maximum(jnp.max(b, axis=1), 0.0) - jnp.minimum(jnp.min(b, axis=1), 0.0)
    )
    spreads = [spread(b) for b in (bk, bv) if b is not None]
    return functools.reduce(jnp.maximum, spreads) <= _FACTORED_RANGE


def _chunk_output(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bk: jax.Array | None,
    bv: jax.Array | None,
    local: tuple[Any, ...],
    h_start: jax.Array,
    st: LinearStatics,
    mode: str,
) -> jax.Array:
    """Every chunk's output [M, C, V]: from the carried state, plus inside the chunk.

    ``mode="factored"`` (every chunk's gates within :data:`_FACTORED_RANGE`) splits each pair's
    decay at the chunk start, ``exp(b_t - b_s) = exp(b_t) · exp(-b_s)``, and reuses the local
    terms: the chunk is two matmuls. ``mode="exact"`` takes the two-level form, safe for any
    gates.
    """
    q_in, k_out, v_out = local[:3]
    inter = _dot("mck,mkv->mcv", q_in, h_start)
    gate_v = None if bv is None else jnp.exp(bv)
    if bv is None and (bk is None or bk.shape[-1] == 1):
        out = inter + _intra_scalar(q, k, v, bk)
    elif mode == "factored":
        k_f = k_out if bk is None else k_out * jnp.exp(-bk[:, -1:])
        v_f = v_out if bv is None else v_out * jnp.exp(-bv[:, -1:])
        scores = jnp.where(_causal(q.shape[1]), _dot("mck,msk->mcs", q_in, k_f), 0.0)
        out = inter + _dot("mcs,msv->mcv", scores, v_f)
        if gate_v is not None:
            out = out * gate_v
    else:
        out = inter if gate_v is None else inter * gate_v
        out = out + _intra_exact(q, k, v, bk, bv, st.sub_chunk)
    return st.scale * out


def _causal(c: int) -> jax.Array:
    return jnp.tril(jnp.ones((c, c), bool))


def _intra_scalar(q: jax.Array, k: jax.Array, v: jax.Array, bk: jax.Array | None) -> jax.Array:
    """Per-head scalar gate: ``((q kᵀ) ⊙ exp(b_t - b_s) ⊙ [s ≤ t]) v`` per chunk (exact)."""
    causal = _causal(q.shape[1])
    scores = _dot("mck,msk->mcs", q, k)
    if bk is None:
        scores = jnp.where(causal, scores, 0.0)
    else:
        b = bk[..., 0]
        scores = scores * jnp.exp(jnp.where(causal, b[:, :, None] - b[:, None, :], -jnp.inf))
    return _dot("mcs,msv->mcv", scores, v)


def _intra_factored(
    q: jax.Array, k: jax.Array, v: jax.Array, bk: jax.Array | None, bv: jax.Array | None
) -> jax.Array:
    """Gates over K and/or V when the chunk's gate spread is small: ``exp(b_t - b_s)`` split
    at the midpoint ``r`` of the chunk's range as ``exp(b_t - r) · exp(r - b_s)``, so the
    whole chunk is two matmuls."""
    if bk is not None:
        r = 0.5 * (jnp.max(bk, axis=1, keepdims=True) + jnp.min(bk, axis=1, keepdims=True))
        q, k = q * jnp.exp(bk - r), k * jnp.exp(r - bk)
    scores = jnp.where(_causal(q.shape[1]), _dot("mck,msk->mcs", q, k), 0.0)
    if bv is None:
        return _dot("mcs,msv->mcv", scores, v)
    r = 0.5 * (jnp.max(bv, axis=1, keepdims=True) + jnp.min(bv, axis=1, keepdims=True))
    return _dot("mcs,msv->mcv", scores, v * jnp.exp(r - bv)) * jnp.exp(bv - r)


def _intra_exact(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bk: jax.Array | None,
    bv: jax.Array | None,
    sub: int,
) -> jax.Array:
    """:func:`_intra_subchunks` over groups of chunk rows, each group rematerialised in the
    backward: its pairwise [c, c, F] decays then never exist for more than one group at a
    time (and a compiled program holding this path as an untaken branch stays small)."""
    m, c, dv = v.shape
    rows = max(1, _EXACT_GROUP_ELEMENTS // (c * sub * max(q.shape[-1], dv)))
    if rows >= m:
        return _intra_subchunks(q, k, v, bk, bv, sub)
    groups = -(-m // rows)
    grouped = lambda x: (
        None if x is None else _pad_axis(x, 0, groups * rows).reshape(groups, rows, *x.shape[1:])
    )
    body = jax.checkpoint(lambda xs: _intra_subchunks(*xs, sub))
    out = lax.map(body, tuple(grouped(x) for x in (q, k, v, bk, bv)))
    return out.reshape(groups * rows, c, dv)[:m]


def _intra_subchunks(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bk: jax.Array | None,
    bv: jax.Array | None,
    sub: int,
) -> jax.Array:
    """Gates over K and/or V, any spread: the two-level form (see the module docstring).

    Arrays stay at most 4-D (XLA's CPU code for 5-D broadcasts is several times slower).
    """
    m, c, dv = v.shape
    n = c // sub
    out = jnp.zeros((m, n, sub, dv), jnp.float32)
    if n > 1:
        out = _intra_off_diagonal(q, k, v, bk, bv, sub)
    split = lambda x: None if x is None else x.reshape(m * n, sub, x.shape[-1])
    q2, k2, v2, bk2, bv2 = (split(x) for x in (q, k, v, bk, bv))  # [M·n, c, F]
    tril = _causal(sub)
    # Diagonal sub-chunks: pairwise decays exp(b_t - b_s), s ≤ t, [M·n, c, c, F].
    if bk2 is None:
        diag = jnp.where(tril, _dot("mck,msk->mcs", q2, k2), 0.0)
    elif bk2.shape[-1] == 1:
        b = bk2[..., 0]
        diag = _dot("mck,msk->mcs", q2, k2) * jnp.exp(
            jnp.where(tril, b[:, :, None] - b[:, None, :], -jnp.inf)
        )
    else:
        ek = jnp.where(tril[:, :, None], bk2[:, :, None, :] - bk2[:, None, :, :], -jnp.inf)
        diag = jnp.sum(q2[:, :, None, :] * k2[:, None, :, :] * jnp.exp(ek), axis=-1)
    if bv2 is None:
        out_diag = _dot("mcs,msv->mcv", diag, v2)
    else:
        ev = jnp.where(tril[:, :, None], bv2[:, :, None, :] - bv2[:, None, :, :], -jnp.inf)
        out_diag = jnp.sum(diag[:, :, :, None] * jnp.exp(ev) * v2[:, None, :, :], axis=2)
    return (out + out_diag.reshape(m, n, sub, dv)).reshape(m, c, dv)


def _intra_off_diagonal(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bk: jax.Array | None,
    bv: jax.Array | None,
    sub: int,
) -> jax.Array:
    """Sub-chunk i against every earlier token of its chunk, [M, n, c, V], with decays split
    at ``r_i``, the cumulative gate at sub-chunk i's first token (flash-linear-attention's
    reference point): ``exp(b_t - r_i)`` for t in sub-chunk i and ``exp(r_i - b_s)`` for
    s before it are both ≤ 1."""
    m, c, _ = v.shape
    n = c // sub
    before = (jnp.arange(c)[None, :] < (jnp.arange(n) * sub)[:, None])[
        None, :, :, None
    ]  # [1, n, C, 1]
    split = lambda x: x.reshape(m, n, sub, x.shape[-1])
    if bk is None:
        q_i = split(q)
        k_i = jnp.where(before, k[:, None], 0.0)
    else:
        r = split(bk)[:, :, :1]  # [M, n, 1, K]
        q_i = split(q) * jnp.exp(split(bk) - r)
        k_i = k[:, None] * jnp.exp(jnp.where(before, r - bk[:, None], -jnp.inf))  # [M, n, C, K]
    scores = _dot("mick,misk->mics", q_i, k_i)  # [M, n, c, C]
    if bv is None:
        return _dot("mics,msv->micv", scores, v)
    r = split(bv)[:, :, :1]
    v_i = v[:, None] * jnp.exp(jnp.where(before, r - bv[:, None], -jnp.inf))
    return _dot("mics,misv->micv", scores, v_i) * jnp.exp(split(bv) - r)


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
