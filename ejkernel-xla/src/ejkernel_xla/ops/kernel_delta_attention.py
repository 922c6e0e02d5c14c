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

Numerics (:mod:`ejkernel_xla.ops._chunk_numerics`): decays are floored at -110 before they
are summed, so a decay of -inf (a state reset) gives exactly 0 like the recurrence; a token
with a non-finite key, ``beta``, decay or value enters the chunk algebra with them zeroed and
the outputs (and the state) from it on are NaN, so a NaN reaches only its causal future.

Everything is float32 inside (the triangular inverse needs it); outputs keep the query dtype,
the final state is float32. Config: ``chunk_size`` (C). It declines nothing (no ``supports``): every
valid call runs here, on every backend.

This module is the op's adapter (config, heuristic, config space, entry point and its
forward/backward); the chunk layout and the passes are in ``_delta_chunked``, the chunk math in
``_delta_intra``.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel.plugins import defvjp
from ejkernel_xla.ops._delta_chunked import Statics, backward, forward
from ejkernel_xla.ops._tuning import backend, check_chunk_size, distinct, fit_chunk

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
#: The op's array arguments (the passes read them by name; ``None`` when absent).
_ARRAYS = ("query", "key", "value", "beta", "g", "initial_state", "cu_seqlens")


@attrs.frozen(kw_only=True)
class KernelDeltaAttentionConfig:
    """Tunables of the XLA chunked gated delta rule.

    Attributes:
        chunk_size: tokens per chunk C (the inter-chunk scan runs S / C steps); any C ≥ 1,
            powers of two are the efficient ones.
    """

    chunk_size: int = attrs.field(default=64, validator=check_chunk_size)


def heuristic(inv: Any) -> KernelDeltaAttentionConfig:
    """The backend's default chunk, shrunk to a power of two for shorter (packed) sequences."""
    chunk = _DEFAULT_CHUNK[backend(_DEFAULT_CHUNK)]
    return KernelDeltaAttentionConfig(chunk_size=fit_chunk(chunk, _typical_length(inv)))


def config_space(inv: Any) -> list[KernelDeltaAttentionConfig]:
    """The heuristic's config, then a few chunk lengths fitted to the sequences."""
    fitted = (fit_chunk(chunk, _typical_length(inv)) for chunk in _TUNING_CHUNKS)
    return distinct([heuristic(inv), *(KernelDeltaAttentionConfig(chunk_size=c) for c in fitted)])


def kernel_delta_attention_xla(
    *, cfg: KernelDeltaAttentionConfig | None = None, **args: Any
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The gated delta rule, chunked: the op's arguments
    (:func:`ejkernel.specs.kernel_delta_attention.kernel_delta_attention`, validated by the
    core) as keywords, and the chunk length ``cfg`` (``None``: the default).

    Returns:
        out [B, S, H, V] in the query dtype, and with ``return_state`` the float32 final state.
    """
    return _kernel_delta_attention_fwd(cfg=cfg, **args)[0]


def _kernel_delta_attention_fwd(
    *, cfg: KernelDeltaAttentionConfig | None = None, **args: Any
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`kernel_delta_attention_xla`: ``(out, residuals)``; the residuals are
    the array inputs only (the backward recomputes the chunked forward), so the primal call
    runs this too and does no extra work."""
    arrays = {n: args.get(n) for n in _ARRAYS}
    return_state = args.get("return_state", False)
    out, final = forward(arrays, _statics(arrays, cfg, **args), return_state)
    return ((out, final) if return_state else out), arrays


def _kernel_delta_attention_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: KernelDeltaAttentionConfig | None = None,
    return_state: bool = False,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`kernel_delta_attention_xla`.

    Returns:
        Gradients of ``query``, ``key``, ``value``, ``beta``, ``g`` and ``initial_state``, each
        in its input's dtype (``None`` for an absent initial state).
    """
    d_o, d_final = d_out if return_state else (d_out, None)
    return backward(residuals, d_o, d_final, _statics(residuals, cfg, **statics))


defvjp(kernel_delta_attention_xla, _kernel_delta_attention_fwd, _kernel_delta_attention_bwd)


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _typical_length(inv: Any) -> int:
    """S, or the mean length S / N of N packed sequences."""
    s = int(inv.kwargs["query"].shape[1])
    cu = inv.kwargs.get("cu_seqlens")
    return s if cu is None else max(1, -(-s // max(1, int(cu.shape[0]) - 1)))


def _statics(
    arrays: dict[str, Any],
    cfg: KernelDeltaAttentionConfig | None,
    *,
    softmax_scale: float | None = None,
    use_qk_l2norm: bool = True,
    **unused: Any,
) -> Statics:
    """The passes' statics from the config and the op's non-array arguments."""
    del unused  # the arrays, and return_state (not a static of the passes)
    chunk = (cfg if cfg is not None else KernelDeltaAttentionConfig()).chunk_size
    dk = arrays["query"].shape[-1]
    return Statics(
        chunk=chunk,
        scale=float(dk**-0.5 if softmax_scale is None else softmax_scale),
        l2norm=bool(use_qk_l2norm),
    )
