"""kernel_delta_attention on XLA: the chunked gated delta rule (WY/UT form), O(S) memory.

Pure JAX with a backward attached through :func:`ejkernel.plugins.defvjp`.

The recurrence (per head; the state ``S`` is ``[K, V]``, ``g`` a log decay per key channel, or
one per head broadcast over K): ``S_t = (I - β_t k_t k_tᵀ) diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ``,
``o_t = q_tᵀ S_t`` (q normalised and scaled first).

Chunked form (Yang, Wang, Zhang, Shen, Kim: "Parallelizing Linear Transformers with the Delta
Rule over Sequence Length", NeurIPS 2024, Sec. 3: the WY representation of a product of
Householder-like factors, computed with the UT transform; Yang, Kautz, Hatamizadeh: "Gated
Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, Sec. 3.3: its gated extension).
The sequence is cut into chunks of C tokens. Inside a chunk with incoming state ``S₀``, let
``G_t = Σ_{s ≤ t} g_s`` be the cumulative decay from the chunk start (``Γ_t = exp(G_t)``) and
``u_t = β_t (v_t - (diag(exp(g_t)) S_{t-1})ᵀ k_t)`` the delta-rule correction of token t. Then
``S_t = diag(Γ_t) S₀ + Σ_{j ≤ t} diag(Γ_t / Γ_j) k_j u_jᵀ``, and substituting it into ``u``
gives one unit lower-triangular system for the whole chunk:

- ``A_tj = β_t Σ_κ k_t[κ] k_j[κ] exp(G_t[κ] - G_j[κ])`` for ``j < t`` (strictly lower);
- ``(I + A) U = diag(β) (V - (K ⊙ Γ) S₀)``; with the UT transform ``T = (I + A)⁻¹``,
  ``W = T diag(β) (K ⊙ Γ)`` and ``Ũ = T diag(β) V`` do not depend on the state, and
  ``U = Ũ - W S₀``;
- outputs ``O = (Q ⊙ Γ) S₀ + P U`` with ``P_tj = Σ_κ q_t[κ] k_j[κ] exp(G_t[κ] - G_j[κ])`` for
  ``j ≤ t`` (zero above the diagonal);
- the next chunk's state ``S_C = diag(Γ_C) S₀ + (K ⊙ exp(G_C - G))ᵀ U``.

Forward, streamed (no ``cu_seqlens``): one ``lax.scan`` over the B·N (batch row, chunk)
pairs, batch-major, reads one chunk of one row, all heads, straight from the [B, S, H, F]
inputs and computes its ``A``, ``P``, ``T``, ``W``, ``Ũ`` and the recurrence while it is in
cache, carrying that row's [H, K, V] state. With per-channel decays ``P`` and ``A`` are then
factored through the chunk start, ``(x ⊙ Γ)(k ⊙ Γ⁻¹)ᵀ`` (one [2C, K] × [K, C] matmul a head),
whenever the chunk's cumulative decays stay within ±80 (a ``lax.cond`` per chunk), else built
hierarchically as below. Packed sequences and the backward use the all-chunks-at-once form:
every chunk's ``A``, ``P``, ``T``, ``W``, ``Ũ`` at once (batched over chunks), and only the
last three lines as a ``lax.scan`` over chunks (four matmuls a step).

Forward cost per token and head (C the chunk, K, V the head dims): the recurrence's four
matmuls 2·K·V (``W S₀``) + 2·K·V (``Q̃ S₀``) + 2·C·V (``P U``) + 2·K·V (``K̃ᵀ U``), the
products ``P``, ``A`` 4·C·K, ``W``, ``Ũ`` 2·C·(K + V), the inverse ≈ C²·log₂C: at C = 32,
K = V = 128 about 139 000 flops, against ≈ 7·K·V = 115 000 vector flops of the sequential
scan (``Sᵀk``, the rank-one update, ``q S``), which also moves its [K, V] state through
memory every step (8·K·V bytes) where the chunked form moves 8·K·V / C. ``T`` is inverted by block
doubling (diagonal blocks of size b merge pairwise:
``[[T₀, 0], [A₁₀, T₁]]⁻¹ = [[T₀, 0], [-T₁ A₁₀ T₀, T₁]]``, log₂ C batched steps; XLA's batched
``triangular_solve`` measured 2.5x slower on CPU; for one [16, 32, 32] step: doubling 94 µs,
``solve_triangular`` 127 µs, the product ``(I - A)(I + A²)(I + A⁴)…`` 107 µs), with the
analytic VJP
``dA = -Tᵀ dT Tᵀ``.

Every exponent is a decay between two tokens in time order, never a growth, so nothing
overflows for ``g ≤ 0`` however strong the decay (a factorisation through the chunk start,
``q_t Γ_t · k_j / Γ_j``, overflows once a chunk decays by more than e⁸⁸):

- scalar ``g``: ``exp(G_t - G_j)`` is a ``[C, C]`` matrix, the exponent masked to ``j ≤ t``
  before ``exp``;
- per-channel ``g``: ``P`` and ``A`` are built hierarchically. The chunk is halved
  recursively; the block of rows in the second half and columns in the first half of a block
  factors through its middle m: ``exp(G_t - G_m) · exp(G_m - G_j)``, both factors ``≤ 1``
  (prefix and suffix products of ``exp(g)`` inside the halves), so the block is a matmul of
  decayed rows. The log₂ C levels tile the strictly lower triangle (a ``C × C × K`` product
  and ``C · K`` exponentials per chunk); the diagonal has no decay. Its VJP is written out:
  ``dq = D(dP, k)``, ``dk = Dᵀ(dP, q)`` for the decayed products ``D(M, y)_t =
  Σ_{j ≤ t} M_tj y_j exp(G_t - G_j)`` (the same hierarchy), ``dG = q ⊙ dq - k ⊙ dk``.

Tails and packing. A sequence that is not a chunk multiple is padded with neutral tokens
(``q = k = v = 0``, ``β = 0``, ``g = 0``: the state passes through). With ``cu_seqlens`` every
packed sequence is chunked on its own: a static table of ``(S + N (C - 1)) // C`` chunk slots
(enough for any split of S tokens into N sequences) is built from the traced offsets; a slot
that starts a sequence replaces the carried state by that sequence's initial state, the slot
that ends it records the final state, and empty sequences (no slot) return their initial
state. Tokens outside every sequence are in no slot and get a zero output.

Backward (custom VJP). The forward keeps only its inputs. The backward recomputes the chunked
forward and pulls the cotangents back through it with ``jax.vjp``: autodiff of the batched
chunk algebra and of the scan over chunks (with the two hand-written VJPs above), whose
residuals are per-chunk quantities (the incoming state of each chunk, ``[S / C, H, K, V]``,
and ``[S, H, C + K + V]`` chunk factors), so memory stays linear in S. This is checkpointing
of the whole chunked forward, not a fully hand-derived backward (as flash-linear-attention's
kernels have): it costs one extra forward.

Everything is float32 inside (the triangular inverse needs it); outputs keep the query dtype,
the final state is float32. Config: ``chunk_size`` (C). It declines nothing (no ``supports``): every
valid call runs here, on every backend.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.plugins import defvjp
from ejkernel.specs.kernel_delta_attention import L2NORM_EPS

__all__ = [
    "KernelDeltaAttentionConfig",
    "config_space",
    "heuristic",
    "kernel_delta_attention_xla",
]

#: Default chunk length C per backend: flash-linear-attention's 64 on accelerators; on CPU 32
#: (T 4096, H 4, K = V 128, both decay kinds: 16 and 32 within noise, 64 and 128 slower).
_DEFAULT_CHUNK: dict[str, int] = {"cpu": 32, "gpu": 64, "tpu": 128}
#: Chunk lengths :func:`config_space` offers.
_TUNING_CHUNKS: tuple[int, ...] = (16, 32, 64, 128)


@attrs.frozen(kw_only=True)
class KernelDeltaAttentionConfig:
    """Tunables of the XLA chunked gated delta rule.

    Attributes:
        chunk_size: tokens per chunk C (the inter-chunk scan runs S / C steps); any C ≥ 1,
            powers of two are the efficient ones.
    """

    chunk_size: int = attrs.field(default=64)

    @chunk_size.validator
    def _check(self, attribute: Any, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"KernelDeltaAttentionConfig: `chunk_size` must be an int >= 1; got {value!r}"
            )


def heuristic(inv: Any) -> KernelDeltaAttentionConfig:
    """The backend's default chunk, shrunk to a power of two for shorter (packed) sequences."""
    return KernelDeltaAttentionConfig(
        chunk_size=_fit_chunk(_DEFAULT_CHUNK[_backend()], _typical_length(inv))
    )


def config_space(inv: Any) -> list[KernelDeltaAttentionConfig]:
    """The heuristic's config, then a few chunk lengths fitted to the sequences."""
    configs = [heuristic(inv)]
    for chunk in _TUNING_CHUNKS:
        cfg = KernelDeltaAttentionConfig(chunk_size=_fit_chunk(chunk, _typical_length(inv)))
        if cfg not in configs:
            configs.append(cfg)
    return configs


def kernel_delta_attention_xla(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    beta: jax.Array,
    g: jax.Array,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: KernelDeltaAttentionConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The gated delta rule, chunked (arguments as validated by the core spec).

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        beta: [B, S, H] step sizes.
        g: [B, S, H, K] or [B, S, H] log-space decays.
        initial_state: [B, H, K, V] ([N, H, K, V] with ``cu_seqlens``) or ``None`` (zeros).
        softmax_scale: scales the query; ``None`` means K ** -0.5.
        use_qk_l2norm: L2-normalise query and key over K first.
        cu_seqlens: [N + 1] offsets of sequences packed along S (B == 1), or ``None``.
        return_state: also return the final state.
        cfg: chunk sizes; ``None`` takes the defaults.

    Returns:
        out [B, S, H, V] in the query dtype, and with ``return_state`` the float32 final state.
    """
    arrays = _arrays(query, key, value, beta, g, initial_state, cu_seqlens)
    st = _statics(arrays, cfg, softmax_scale, use_qk_l2norm)
    out, final = _forward(arrays, st, return_state)
    return (out, final) if return_state else out


def _kernel_delta_attention_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    beta: jax.Array,
    g: jax.Array,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: KernelDeltaAttentionConfig | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`kernel_delta_attention_xla`: ``(out, residuals)``; the residuals are
    the array inputs only (the backward recomputes the chunked forward)."""
    arrays = _arrays(query, key, value, beta, g, initial_state, cu_seqlens)
    st = _statics(arrays, cfg, softmax_scale, use_qk_l2norm)
    out, final = _forward(arrays, st, return_state)
    return ((out, final) if return_state else out), arrays


def _kernel_delta_attention_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: KernelDeltaAttentionConfig | None = None,
    softmax_scale: float | None = None,
    use_qk_l2norm: bool = True,
    return_state: bool = False,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`kernel_delta_attention_xla`.

    Returns:
        Gradients of ``query``, ``key``, ``value``, ``beta``, ``g`` and ``initial_state``, each
        in its input's dtype (``None`` for an absent initial state).
    """
    st = _statics(residuals, cfg, softmax_scale, use_qk_l2norm)
    d_o, d_final = d_out if return_state else (d_out, None)
    return _backward(residuals, d_o, d_final, st)


defvjp(kernel_delta_attention_xla, _kernel_delta_attention_fwd, _kernel_delta_attention_bwd)


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _backend() -> str:
    name = jax.default_backend().lower()
    name = "gpu" if name in ("cuda", "rocm") else name
    return name if name in _DEFAULT_CHUNK else "cpu"


def _typical_length(inv: Any) -> int:
    """S, or the mean length S / N of N packed sequences."""
    s = int(inv.kwargs["query"].shape[1])
    cu = inv.kwargs.get("cu_seqlens")
    return s if cu is None else max(1, -(-s // max(1, int(cu.shape[0]) - 1)))


def _fit_chunk(chunk: int, length: int) -> int:
    """``chunk``, or the smallest power of two covering a shorter sequence."""
    if length >= chunk:
        return chunk
    return 1 << max(0, (length - 1).bit_length())


@attrs.frozen(kw_only=True)
class _Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    chunk: int
    scale: float
    l2norm: bool


def _statics(
    arrays: dict[str, Any],
    cfg: KernelDeltaAttentionConfig | None,
    softmax_scale: float | None,
    use_qk_l2norm: bool,
) -> _Statics:
    chunk = (cfg if cfg is not None else KernelDeltaAttentionConfig()).chunk_size
    dk = arrays["query"].shape[-1]
    return _Statics(
        chunk=chunk,
        scale=float(dk**-0.5 if softmax_scale is None else softmax_scale),
        l2norm=bool(use_qk_l2norm),
    )


def _arrays(
    query: Any, key: Any, value: Any, beta: Any, g: Any, initial_state: Any, cu_seqlens: Any
) -> dict[str, Any]:
    return {
        "query": query,
        "key": key,
        "value": value,
        "beta": beta,
        "g": g,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }


# --------------------------------------------------------------------------------------------
# Chunk layout: [B, S, H, ...] <-> [M, B, H, C, ...] (dense, or packed sequences)
# --------------------------------------------------------------------------------------------


class _Packed(NamedTuple):
    """Where each chunk slot's tokens come from when sequences are packed (B == 1)."""

    token: jax.Array  # [M, C] token index, S for a padding position
    seq: jax.Array  # [M] sequence owning the slot (clipped for unused slots)
    first: jax.Array  # [M] the slot starts its sequence: load its initial state
    last: jax.Array  # [M] the slot ends its sequence: record its final state
    slot_of_token: jax.Array  # [S]
    pos_of_token: jax.Array  # [S]
    inside: jax.Array  # [S] the token belongs to a sequence (else its output is zero)


def _num_slots(s: int, n: int, c: int) -> int:
    """Chunk slots enough for any split of S tokens into N sequences: Σ ceil(L_n / C)."""
    return max(1, (s + n * (c - 1)) // c)


def _packed_layout(cu_seqlens: jax.Array, s: int, c: int) -> _Packed:
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    m = _num_slots(s, n, c)
    lengths = cu[1:] - cu[:-1]
    chunks = (lengths + c - 1) // c
    ends = jnp.cumsum(chunks)
    starts = ends - chunks
    slot = jnp.arange(m, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), n - 1).astype(jnp.int32)
    used = slot < ends[-1]
    index = slot - starts[seq]
    valid = jnp.where(used, jnp.clip(lengths[seq] - index * c, 0, c), 0)
    pos = jnp.arange(c, dtype=jnp.int32)
    token = jnp.where(pos < valid[:, None], (cu[seq] + index * c)[:, None] + pos, s)
    t = jnp.arange(s, dtype=jnp.int32)
    seq_t = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), n - 1)
    offset = t - cu[seq_t]
    return _Packed(
        token=token,
        seq=seq,
        first=used & (index == 0),
        last=used & (index == chunks[seq] - 1),
        slot_of_token=starts[seq_t] + offset // c,
        pos_of_token=offset % c,
        inside=(t >= cu[0]) & (t < cu[-1]),
    )


def _to_chunks(x: jax.Array, c: int, packed: _Packed | None) -> jax.Array:
    """[B, S, H, *F] -> [M, B, H, C, *F], padding positions zero."""
    b, s = x.shape[:2]
    if packed is None:
        m = -(-s // c)
        x = jnp.pad(x, [(0, 0), (0, m * c - s)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, m, c, *x.shape[2:])
        return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2))
    rows = jnp.concatenate([x[0], jnp.zeros((1, *x.shape[2:]), x.dtype)])  # row S: padding
    x = rows[packed.token]  # [M, C, H, *F]
    return jnp.moveaxis(x, (0, 1, 2), (0, 2, 1))[:, None]


def _from_chunks(x: jax.Array, s: int, packed: _Packed | None) -> jax.Array:
    """[M, B, H, C, F] -> [B, S, H, F] (the inverse of :func:`_to_chunks` on real tokens)."""
    m, b, h, c, f = x.shape
    if packed is None:
        x = jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2)).reshape(b, m * c, h, f)
        return x[:, :s]
    x = jnp.moveaxis(x[:, 0], 1, 2)  # [M, C, H, F]
    x = x[jnp.clip(packed.slot_of_token, 0, m - 1), packed.pos_of_token]
    return jnp.where(packed.inside[:, None, None], x, 0.0)[None]


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


class _Chunk(NamedTuple):
    """Chunked inputs (float32), [M, B, H, C, ...]."""

    q: jax.Array  # normalised and scaled
    k: jax.Array
    v: jax.Array
    beta: jax.Array  # [..., C]
    g: jax.Array  # [..., C, K] or [..., C]


@functools.partial(jax.jit, static_argnames=("st", "return_state"))
def _forward(
    arrays: dict[str, Any], st: _Statics, return_state: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``(out [B, S, H, V], final_state or None)``: the streaming form unless sequences are
    packed."""
    if arrays["cu_seqlens"] is None and arrays["query"].shape[1] > 0:
        return _streamed(arrays, st, return_state)
    return _chunked(arrays, st)


def _streamed(
    arrays: dict[str, Any], st: _Statics, return_state: bool
) -> tuple[jax.Array, jax.Array | None]:
    """The forward as one ``lax.scan`` over the B·N (batch row, chunk) pairs, batch-major.

    Each step reads one chunk of one batch row, all H heads, straight from the input layout
    ([B, S, H, F] viewed as [B·N, C, H, F]: no transpose or normalisation pass over the whole
    inputs), and while it is in cache normalises q and k, builds the chunk's UT transform
    ([H, C, C] products, the triangular inverse, ``W`` and ``Ũ``) and runs the recurrence on
    the carried [H, K, V] state of that row (reset at the row's first chunk). Only the outputs
    leave the loop (and the final states with ``return_state``); the all-chunks-at-once form
    (:func:`_chunked`) builds every chunk's factors first, [S / C, B, H, C, C + 2K + V] floats
    streamed through memory, and stays the packed-sequence path and the backward's.
    """
    f32 = lambda x: x.astype(jnp.float32)
    query = arrays["query"]
    b, s, h, dk = query.shape
    dv = arrays["value"].shape[-1]
    c = st.chunk
    n = -(-s // c)
    rows = lambda x: _pad_axis(x, 1, n * c).reshape(b * n, c, *x.shape[2:])
    inits = _initial_states(arrays)
    heads = lambda x: jnp.swapaxes(x, 0, 1)  # [C, H, ...] -> [H, C, ...] (in cache)

    def step(carry: Any, xs: Any) -> tuple[Any, jax.Array]:
        state, finals = carry
        q, k, v, beta, g, i = xs
        row = i // n
        start = lax.dynamic_index_in_dim(inits, row, axis=0, keepdims=False)
        state = jnp.where(i % n == 0, start, state)
        q, k = f32(q), f32(k)
        if st.l2norm:
            q, k = _l2_normalize(q), _l2_normalize(k)
        chunk = _Chunk(
            q=heads(q * st.scale), k=heads(k), v=heads(f32(v)), beta=heads(beta), g=heads(g)
        )
        out, new = _recurrence(_ut_transform(chunk, st, factor=True), state)
        if finals is not None:
            keep = lax.dynamic_index_in_dim(finals, row, axis=0, keepdims=False)
            finals = lax.dynamic_update_index_in_dim(
                finals, jnp.where(i % n == n - 1, new, keep), row, axis=0
            )
        return (new, finals), heads(out)

    finals = jnp.zeros((b, h, dk, dv), jnp.float32) if return_state else None
    carry = (jnp.zeros((h, dk, dv), jnp.float32), finals)
    xs = (
        rows(query),
        rows(arrays["key"]),
        rows(arrays["value"]),
        rows(f32(arrays["beta"])),
        rows(f32(arrays["g"])),
        jnp.arange(b * n, dtype=jnp.int32),
    )
    (_, finals), out = lax.scan(step, carry, xs)
    out = out.reshape(b, n * c, h, dv)[:, :s].astype(query.dtype)
    return out, finals


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``axis`` of ``x`` to ``size`` (neutral tokens: q = k = v = β = g = 0)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames="st")
def _backward(
    arrays: dict[str, Any], d_o: jax.Array, d_final: jax.Array | None, st: _Statics
) -> dict[str, jax.Array | None]:
    """Recompute the chunked forward and pull the cotangents back through it."""
    names = ["query", "key", "value", "beta", "g"]
    if arrays["initial_state"] is not None:
        names.append("initial_state")
    diff = {n: arrays[n] for n in names}
    (_, final), pull_back = jax.vjp(lambda a: _chunked({**arrays, **a}, st), diff)
    d_final = jnp.zeros_like(final) if d_final is None else d_final.astype(final.dtype)
    (grads,) = pull_back((d_o.astype(arrays["query"].dtype), d_final))
    return {"initial_state": None, **grads}


def _chunked(arrays: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array]:
    """The whole chunked algorithm: the UT transform of every chunk at once, then the
    inter-chunk recurrence and each chunk's output as a scan over chunks."""
    query = arrays["query"]
    s = query.shape[1]
    cu = arrays["cu_seqlens"]
    packed = None if cu is None else _packed_layout(cu, s, st.chunk)
    p = _ut_transform(_prepare(arrays, st, packed), st)
    inits = _initial_states(arrays)
    if packed is None:

        def body(state: jax.Array, x: _Prepared) -> tuple[jax.Array, jax.Array]:
            out, new = _recurrence(x, state)
            return new, out

        final, out = lax.scan(body, inits, p)
    else:

        def packed_body(carry: Any, x: Any) -> tuple[Any, Any]:
            state, finals = carry
            x, seq, first, last = x
            state = jnp.where(first, inits[seq][None], state)  # a sequence starts afresh
            out, new = _recurrence(x, state)
            finals = finals.at[seq].set(jnp.where(last, new[0], finals[seq]))
            return (new, finals), out

        carry = (inits[:1], inits)  # empty sequences keep their initial state
        (_, final), out = lax.scan(packed_body, carry, (p, packed.seq, packed.first, packed.last))
    return _from_chunks(out, s, packed).astype(query.dtype), final


def _prepare(arrays: dict[str, Any], st: _Statics, packed: _Packed | None) -> _Chunk:
    """Normalise, scale, cast to float32 and lay the inputs out in chunks ``[M, B, H, C, ...]``."""
    f32 = lambda x: x.astype(jnp.float32)
    q, k = f32(arrays["query"]), f32(arrays["key"])
    if st.l2norm:
        q, k = _l2_normalize(q), _l2_normalize(k)
    q = q * st.scale
    to = lambda x: _to_chunks(x, st.chunk, packed)
    beta = to(f32(arrays["beta"])[..., None])[..., 0]
    g = f32(arrays["g"])
    g = to(g) if g.ndim == 4 else to(g[..., None])[..., 0]
    return _Chunk(q=to(q), k=to(k), v=to(f32(arrays["value"])), beta=beta, g=g)


def _l2_normalize(x: jax.Array) -> jax.Array:
    """The spec's ``x / sqrt(Σ x² + eps)``; the sum of squares as a dot, which XLA on CPU runs
    far faster than a fused multiply-reduce."""
    return x * lax.rsqrt(_dot("...k,...k->...", x, x)[..., None] + L2NORM_EPS)


def _initial_states(arrays: dict[str, Any]) -> jax.Array:
    """[B or N, H, K, V] float32 (zeros when not given)."""
    init = arrays["initial_state"]
    if init is not None:
        return init.astype(jnp.float32)
    q, v = arrays["query"], arrays["value"]
    cu = arrays["cu_seqlens"]
    n = q.shape[0] if cu is None else cu.shape[0] - 1
    return jnp.zeros((n, q.shape[2], q.shape[3], v.shape[3]), jnp.float32)


# --------------------------------------------------------------------------------------------
# Chunk math
# --------------------------------------------------------------------------------------------


class _Prepared(NamedTuple):
    """What the inter-chunk recurrence and the outputs need (none of it depends on the state)."""

    w: jax.Array  # [..., C, K]  T diag(β) (K ⊙ Γ)
    u: jax.Array  # [..., C, V]  T diag(β) V
    k_to_end: jax.Array  # [..., C, K]  K ⊙ exp(G_C - G)
    decay: jax.Array  # [..., K]  γ_C
    qk: jax.Array  # [..., C, C]  Σ_k q_t k_j exp(G_t - G_j), masked to j ≤ t
    q_decayed: jax.Array  # [..., C, K]  Q ⊙ Γ


def _ut_transform(ch: _Chunk, st: _Statics, factor: bool = False) -> _Prepared:
    """The state-independent part of every chunk: decays and the WY factors (UT transform).

    With ``factor`` (the streaming forward, one chunk of all heads at a time) per-channel
    decays take the factored products ``(x ⊙ Γ)(k ⊙ Γ⁻¹)ᵀ`` (two matmuls) whenever the
    chunk's cumulative decays stay within ±:data:`_FACTORED_RANGE` (a ``lax.cond`` on the
    chunk), else the hierarchical products; without it always the hierarchical ones.
    """
    q, k, v, beta, g = ch
    c = q.shape[-2]
    t = jnp.arange(c)
    # Cumulative sums as a matmul with a triangle of ones: XLA on CPU would otherwise fuse the
    # scan (a reduce-window) into each consumer and redo it for every element.
    ones = (t[:, None] >= t[None, :]).astype(jnp.float32)
    if g.ndim == beta.ndim:  # one decay per head: [C, C] pairwise decays, masked before exp
        cum = _dot("tj,...j->...t", ones, g)
        pair = jnp.exp(
            jnp.where(t[:, None] >= t[None, :], cum[..., :, None] - cum[..., None, :], -jnp.inf)
        )
        qk = _dot("...tk,...jk->...tj", q, k) * pair
        kk = _dot("...tk,...jk->...tj", k, k) * pair
        cum = cum[..., None]
    else:
        cum = _dot("tj,...jk->...tk", ones, g)  # [..., C, K]
        if factor:
            qk, kk = _channel_products(q, k, g, cum)
        else:
            qk, kk = _decayed_products(q, k, g)
    gamma = jnp.exp(cum)
    a = beta[..., :, None] * jnp.where(t[:, None] > t[None, :], kk, 0.0)
    ut = _unit_lower_inverse(a)  # T = (I + A)⁻¹
    dk = k.shape[-1]
    sol = _dot("...tj,...jf->...tf", ut, beta[..., None] * jnp.concatenate([k * gamma, v], axis=-1))
    return _Prepared(
        w=sol[..., :dk],
        u=sol[..., dk:],
        k_to_end=k * jnp.exp(cum[..., -1:, :] - cum),
        decay=jnp.broadcast_to(gamma[..., -1, :], (*k.shape[:-2], dk)),
        qk=qk,
        q_decayed=q * gamma,
    )


#: Largest spread of a chunk's cumulative log decays (chunk start included) for which the
#: factored products run: every factor exp(±G) stays within exp(±80), short of float32's
#: overflow (exp(88.7)) and of its subnormals (exp(-87.3)).
_FACTORED_RANGE = 80.0


def _channel_products(
    q: jax.Array, k: jax.Array, g: jax.Array, cum: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`_decayed_products` for one chunk of all heads, factored through the chunk start
    when its decays allow: ``exp(G_t - G_j) = exp(G_t) · exp(-G_j)``, so both products are
    one [2C, K] × [K, C] matmul per head (lower triangle kept, diagonal included)."""
    spread = jnp.maximum(jnp.max(cum), 0.0) - jnp.minimum(jnp.min(cum), 0.0)

    def factored() -> tuple[jax.Array, jax.Array]:
        c = q.shape[-2]
        t = jnp.arange(c)
        e = jnp.exp(cum)
        both = _dot("...tk,...jk->...tj", jnp.concatenate([q * e, k * e], axis=-2), k / e)
        both = jnp.where(t[:, None] >= t[None, :], both.reshape(*both.shape[:-2], 2, c, c), 0.0)
        return both[..., 0, :, :], both[..., 1, :, :]

    # The factored products are computed outside the conditional, which only passes them on
    # or builds the hierarchical ones instead (their factors overflow there and are dropped):
    # inside the branch they would not overlap the rest of the step on XLA:CPU, about 16 %
    # slower at B 8, H 16, K = V = 128.
    fast = factored()
    return lax.cond(spread <= _FACTORED_RANGE, lambda: fast, lambda: _decayed_products(q, k, g))


def _recurrence(p: _Prepared, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk given its incoming state: ``U = Ũ - W S₀``, ``O = (Q ⊙ Γ) S₀ + P U`` and
    ``S_C = diag(γ_C) S₀ + (K ⊙ exp(G_C - G))ᵀ U``."""
    u = p.u - _dot("...ck,...kv->...cv", p.w, state)
    out = _dot("...ck,...kv->...cv", p.q_decayed, state) + _dot("...tj,...jv->...tv", p.qk, u)
    return out, p.decay[..., None] * state + _dot("...ck,...cv->...kv", p.k_to_end, u)


@jax.custom_vjp
def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)⁻¹`` for strictly lower-triangular ``a [..., C, C]``, by block doubling.

    Diagonal blocks of size b are inverted, then pairs merge:
    ``[[T₀, 0], [A₁₀, T₁]]⁻¹ = [[T₀, 0], [-T₁ A₁₀ T₀, T₁]]`` (log₂ C batched steps; C is
    padded to a power of two with identity rows). Its VJP is the inverse's:
    ``dA = -(Tᵀ dT Tᵀ)`` on the strictly lower triangle.
    """
    c = a.shape[-1]
    size = 1 << max(0, (c - 1).bit_length())
    lead = a.shape[:-2]
    if size != c:
        a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, size - c), (0, size - c)])
    inv = jnp.ones((*lead, size, 1, 1), a.dtype)
    b = 1
    while b < size:
        n = size // (2 * b)
        below = _lower_blocks(a, b)  # [..., n, b, b]: block (2i+1, 2i)
        pairs = inv.reshape(*lead, n, 2, b, b)
        t0, t1 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -_dot("...ij,...jk->...ik", t1, _dot("...ij,...jk->...ik", below, t0))
        inv = _merge(inv, corner, n, b)
        b *= 2
    return inv[..., 0, :c, :c]


def _unit_lower_inverse_fwd(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    t = _unit_lower_inverse(a)
    return t, t


def _unit_lower_inverse_bwd(t: jax.Array, d_t: jax.Array) -> tuple[jax.Array]:
    c = t.shape[-1]
    i = jnp.arange(c)
    d_a = -_dot("...ji,...jk->...ik", t, _dot("...ij,...kj->...ik", d_t, t))
    return (jnp.where(i[:, None] > i[None, :], d_a, 0.0),)


_unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _decayed_products(q: jax.Array, k: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``Σ_κ x_t[κ] k_j[κ] exp(G_t[κ] - G_j[κ])`` for x = q and x = k, for ``j ≤ t``
    (``G`` the cumulative sum of the log decays ``g`` [..., C, K] inside the chunk).

    Hierarchically, without one factor above 1: the chunk is halved recursively, and the block
    of rows t in the second half and columns j in the first half of one block factors through
    the end ``m`` of the first half: ``exp(G_t - G_m) · exp(G_m - G_j)``, both ``≤ 1`` for
    ``g ≤ 0``, so the block is a matmul of decayed rows. The blocks of the log₂ C levels tile
    the strictly lower triangle; the diagonal has no decay. The factors are products of the
    per-token decays ``exp(g)`` within each block (prefix products for rows, suffix products
    for columns), built level by level from the previous one: C·K exponentials per chunk, and a
    ``C × C × K`` product. Returns two ``[..., C, C]`` arrays, zero above the diagonal.
    """
    *lead, c, _ = q.shape
    size = 1 << max(0, (c - 1).bit_length())
    if size != c:  # pad to a power of two with empty tokens that do not decay
        pad = [(0, 0)] * len(lead) + [(0, size - c), (0, 0)]
        q, k, g = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(g, pad)
    qk, kk = _gram(q, k, g)
    return qk[..., :c, :c], kk[..., :c, :c]


def _halves(x: jax.Array, b: int) -> jax.Array:
    """[..., C, K] -> [..., C / 2b, 2, b, K]: blocks of 2b rows, split in halves."""
    *lead, c, dk = x.shape
    return x.reshape(*lead, c // (2 * b), 2, b, dk)


def _bridges(g: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per level (half size b = 1, 2, 4, ...), the decays through the middle ``m`` of each 2b
    block: ``exp(G_t - G_m)`` for the rows of its second half and ``exp(G_m - G_j)`` for the
    rows of its first half, each [..., C / 2b, b, K] and ``≤ 1``.

    ``prefix`` holds the product of ``exp(g)`` from the start of the token's b-block through
    it, ``suffix`` from after it to the end of its b-block; merging two b-blocks multiplies the
    second half's prefixes by the first half's total and the first half's suffixes by the
    second half's total.
    """
    prefix = jnp.exp(g)
    suffix = jnp.ones_like(prefix)
    out = []
    for b in _levels(g.shape[-2]):
        ph, sh = _halves(prefix, b), _halves(suffix, b)
        out.append((ph[..., 1, :, :], sh[..., 0, :, :]))
        first_total, second_total = ph[..., 0, -1:, :], ph[..., 1, -1:, :]
        prefix = jnp.stack([ph[..., 0, :, :], ph[..., 1, :, :] * first_total], axis=-3).reshape(
            g.shape
        )
        suffix = jnp.stack([sh[..., 0, :, :] * second_total, sh[..., 1, :, :]], axis=-3).reshape(
            g.shape
        )
    return out


def _lower_blocks(m: jax.Array, b: int) -> jax.Array:
    """[..., C, C] -> its blocks (second half, first half) of each 2b block: [..., C / 2b, b, b]."""
    *lead, c, _ = m.shape
    n = c // (2 * b)
    grid = m.reshape(*lead, n, 2, b, n, 2, b)
    blocks = jnp.diagonal(grid[..., :, 1, :, :, 0, :], axis1=-4, axis2=-2)  # [..., b, b, n]
    return jnp.moveaxis(blocks, -1, -3)


def _levels(c: int) -> list[int]:
    return [1 << i for i in range(max(0, (c - 1).bit_length()))]


@jax.custom_vjp
def _gram(q: jax.Array, k: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`_decayed_products` for C a power of two."""
    blocks_q = _dot("...tk,...tk->...t", q, k)[..., None, None]  # [..., C, 1, 1]
    blocks_k = _dot("...tk,...tk->...t", k, k)[..., None, None]
    for b, (rows, cols) in zip(_levels(q.shape[-2]), _bridges(g)):
        cols = _halves(k, b)[..., 0, :, :] * cols
        n = rows.shape[-3]
        blocks_q = _merge(
            blocks_q, _dot("...ik,...jk->...ij", _halves(q, b)[..., 1, :, :] * rows, cols), n, b
        )
        blocks_k = _merge(
            blocks_k, _dot("...ik,...jk->...ij", _halves(k, b)[..., 1, :, :] * rows, cols), n, b
        )
    return blocks_q[..., 0, :, :], blocks_k[..., 0, :, :]


def _gram_fwd(q: jax.Array, k: jax.Array, g: jax.Array) -> tuple[Any, Any]:
    return _gram(q, k, g), (q, k, g)


def _gram_bwd(res: Any, cot: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
    """With ``P_tj = Σ_κ x_tκ y_jκ e_tjκ``: ``dx = D(dP, y)``, ``dy = Dᵀ(dP, x)`` for the
    decayed products ``D(M, y)_t = Σ_{j ≤ t} M_tj y_j e_tj`` (same hierarchy as the forward),
    and ``dG = x ⊙ dx - y ⊙ dy`` (the diagonal carries no decay, and its terms cancel); then
    ``dg_s = Σ_{t ≥ s} dG_t``."""
    q, k, g = res
    c = q.shape[-2]
    t = jnp.arange(c)
    lower = t[:, None] >= t[None, :]
    d_qk, d_kk = (jnp.where(lower, d, 0.0) for d in cot)
    bridges = _bridges(g)
    dq = _decayed_rows(d_qk, k, bridges)
    dk_cols = _decayed_cols(d_qk, q, bridges)
    dk_rows_kk = _decayed_rows(d_kk, k, bridges)
    dk_cols_kk = _decayed_cols(d_kk, k, bridges)
    d_cum = q * dq - k * dk_cols + k * (dk_rows_kk - dk_cols_kk)
    d_g = _dot("ts,...tk->...sk", lower.astype(jnp.float32), d_cum)
    return dq, dk_cols + dk_rows_kk + dk_cols_kk, d_g


_gram.defvjp(_gram_fwd, _gram_bwd)


def _decayed_rows(m: jax.Array, y: jax.Array, bridges: list[Any]) -> jax.Array:
    """``out_t = Σ_{j ≤ t} m_tj y_j exp(G_t - G_j)`` for lower-triangular ``m`` [..., C, C]."""
    out = _dot("...tt,...tk->...tk", m, y)
    for b, (rows, cols) in zip(_levels(m.shape[-1]), bridges):
        part = rows * _dot(
            "...ij,...jk->...ik", _lower_blocks(m, b), _halves(y, b)[..., 0, :, :] * cols
        )
        out = out + jnp.concatenate(
            [jnp.zeros_like(part)[..., None, :, :], part[..., None, :, :]], axis=-3
        ).reshape(out.shape)
    return out


def _decayed_cols(m: jax.Array, x: jax.Array, bridges: list[Any]) -> jax.Array:
    """``out_j = Σ_{t ≥ j} m_tj x_t exp(G_t - G_j)`` for lower-triangular ``m`` [..., C, C]."""
    out = _dot("...tt,...tk->...tk", m, x)
    for b, (rows, cols) in zip(_levels(m.shape[-1]), bridges):
        part = cols * _dot(
            "...ij,...ik->...jk", _lower_blocks(m, b), _halves(x, b)[..., 1, :, :] * rows
        )
        out = out + jnp.concatenate(
            [part[..., None, :, :], jnp.zeros_like(part)[..., None, :, :]], axis=-3
        ).reshape(out.shape)
    return out


def _merge(blocks: jax.Array, corner: jax.Array, n: int, b: int) -> jax.Array:
    """Diagonal blocks [..., 2n, b, b] and lower corners [..., n, b, b] -> [..., n, 2b, 2b]."""
    pairs = blocks.reshape(*blocks.shape[:-3], n, 2, b, b)
    first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
    top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([corner, second], axis=-1)], axis=-2)


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
