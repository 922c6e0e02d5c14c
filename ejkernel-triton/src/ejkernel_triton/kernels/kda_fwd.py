"""Triton chunked gated delta rule, forward (Kimi Delta Attention; Gated DeltaNet for a scalar
gate), in the WY/UT form (Yang et al., NeurIPS 2024, Sec. 3; Yang, Kautz, Hatamizadeh, ICLR
2025, Sec. 3.3).

Kernel signatures follow jax-triton's order: inputs (arrays, then scalars), outputs, constexprs.
Both kernels read the chunk layout of :mod:`ejkernel_triton.ops.gla_layout`: tokens
``[B, T, H, F]`` with ``T = NT · C`` (packed sequences start on chunk boundaries, padding slots
hold zeros: ``β = 0`` and ``g = 0`` pass the state through), one int32 flag word per chunk
(``sid << 2 | last << 1 | first``). A gate is ``[B, T, H, GK]``: ``GK = K`` decays each key
channel, ``GK = 1`` one decay per head.

- :func:`kda_fwd_prep_kernel`, one program per (chunk, batch row, head), holds the whole chunk
  (``C`` tokens, all of K and V): the L2 norm of q and k (``use_qk_l2norm``), the query scale,
  the float32 cumulative log gate ``G`` inside the chunk (gates floored at ``-GATE_FLOOR``,
  whose exp is 0 in float32: −inf is a reset and the sums stay finite), the relative decays
  ``exp(G_t − G_j)`` for ``j ≤ t`` only (never a growth), and from them
  ``P_tj = Σ_κ q_tκ k_jκ exp(G_tκ − G_jκ)`` (``j ≤ t``),
  ``A_tj = β_t Σ_κ k_tκ k_jκ exp(G_tκ − G_jκ)`` (``j < t``), ``T = (I + A)⁻¹`` by forward
  substitution, ``W = T diag(β) (K ⊙ exp(G))`` and ``U = T diag(β) V``; it also writes
  ``q ⊙ exp(G)``, ``k ⊙ exp(G_C − G)`` and the chunk's decay ``exp(G_C)``.
- :func:`kda_fwd_h_kernel` walks the chunks of one (V block, batch row, head) in order with
  the float32 state ``S [K, BV]``: ``V' = U − W S``,
  ``S ← diag(exp(G_C)) S + (k ⊙ exp(G_C − G))ᵀ V'``; it restarts from the initial state where
  a sequence begins, writes each chunk's starting state and ``V'``, and each sequence's final
  state. Only this walk is sequential.
- :func:`kda_fwd_o_kernel`, one program per (chunk, V block, batch row, head), the outputs
  ``o = (q ⊙ exp(G)) S + P V'``.

The chunk algebra the forward and backward kernels share is
:mod:`ejkernel_triton.kernels.kda_common`.

Non-finite inputs stay in their causal future (as :mod:`ejkernel_xla.ops._chunk_numerics`
has it): a token whose key, ``β`` or gate is not finite enters the chunk algebra with them and
its value zeroed, a non-finite value entry alone is zeroed, and the rows of ``U`` from the
first such token on are NaN (per value channel), so the state turns NaN there; the output
kernel keeps NaN rows of ``V'`` out of ``P V'``'s earlier rows and sets the outputs from the
first NaN row on to NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.kda_common import (
    chunk_flags,
    chunk_inputs,
    chunk_tiles,
    decayed_products,
    finite,
    l2_normalise,
    unit_lower_inverse,
    walk_tiles,
)


@triton.jit
def kda_fwd_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    scale,
    NT,
    H,
    qg_ptr,
    kg_ptr,
    w_ptr,
    u_ptr,
    p_ptr,
    decay_ptr,
    t_ptr,
    kk_ptr,
    scratch_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
    STORE_FACTORS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``: one chunk's ``q ⊙ exp(G)`` and ``k ⊙ exp(G_C − G)`` ([B, T, H, K],
    the input dtype), ``W`` [B, T, H, K], ``U`` [B, T, H, V] (input dtype), ``P`` [B, T, H, C]
    and the decay ``exp(G_C)`` [B, NT, H, GK] (float32); with ``STORE_FACTORS`` (for the
    backward) also ``T`` and the decayed ``K Kᵀ`` [B, T, H, C] (float32); ``scratch [B, NT, H, 2 C BK]``
    (float32, a per-channel gate's only) is the program's own room for
    :func:`~ejkernel_triton.kernels.kda_common.decayed_products`."""
    o_c, o_k, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    b_q, b_k, b_beta, b_g, bad, _ = chunk_inputs(
        q_ptr, k_ptr, beta_ptr, g_ptr, rows, p_k, m_k, GK, GATE_FLOOR
    )
    if L2NORM:
        b_q, _ = l2_normalise(b_q)
        b_k, _ = l2_normalise(b_k)
    b_q = b_q * scale
    b_gc = tl.cumsum(b_g, axis=0)
    scratch = scratch_ptr + slot * 2 * C * BK
    b_p, b_kk = decayed_products(b_q, b_k, b_gc, o_c, o_k, scratch, C, BK, GK, DOT_PRECISION)
    tl.store(p_ptr + rows[:, None] * C + o_c[None, :], b_p)
    # each tile is stored as soon as it is final, which keeps few of them live at once
    dt = qg_ptr.dtype.element_ty
    if GK == 1:
        b_glast = tl.sum(tl.where(o_c == C - 1, b_gc, 0.0), axis=0)
        b_gamma = tl.exp(b_gc)[:, None]
        b_to_end = tl.exp(b_glast - b_gc)[:, None]
        tl.store(decay_ptr + slot, tl.exp(b_glast))
    else:
        b_glast = tl.sum(tl.where(o_c[:, None] == C - 1, b_gc, 0.0), axis=0)
        b_gamma = tl.exp(b_gc)
        b_to_end = tl.exp(b_glast[None, :] - b_gc)
        p_d = decay_ptr + slot * K + o_k
        tl.store(p_d, tl.exp(b_glast), mask=m_k)
    tl.store(qg_ptr + p_k, (b_q * b_gamma).to(dt), mask=m_k[None, :])
    tl.store(kg_ptr + p_k, (b_k * b_to_end).to(dt), mask=m_k[None, :])
    b_a = tl.where(o_c[:, None] > o_c[None, :], b_beta[:, None] * b_kk, 0.0)
    if STORE_FACTORS:
        tl.store(kk_ptr + rows[:, None] * C + o_c[None, :], b_kk)
    b_t = unit_lower_inverse(b_a, o_c, C, DOT_PRECISION)
    if STORE_FACTORS:
        tl.store(t_ptr + rows[:, None] * C + o_c[None, :], b_t)
    b_w = tl.dot(b_t, b_beta[:, None] * b_k * b_gamma, input_precision=DOT_PRECISION)
    tl.store(w_ptr + p_k, b_w.to(dt), mask=m_k[None, :])
    # a token with a non-finite key, beta or gate has its value NaN-marked
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    p_v = rows[:, None] * V + o_v[None, :]
    b_v = tl.load(v_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
    ok_v = finite(b_v) & ~bad[:, None]
    b_v = tl.where(ok_v, b_v, 0.0)
    first = tl.min(tl.where(ok_v, C, o_c[:, None]), axis=0)  # [BV]: first non-finite token
    b_u = tl.dot(b_t, b_beta[:, None] * b_v, input_precision=DOT_PRECISION)
    b_u = tl.where(o_c[:, None] >= first[None, :], float("nan"), b_u)
    tl.store(u_ptr + p_v, b_u.to(dt), mask=m_v[None, :])


@triton.jit
def kda_fwd_h_kernel(
    kg_ptr,
    w_ptr,
    u_ptr,
    decay_ptr,
    init_ptr,
    flags_ptr,
    NT,
    H,
    R,
    final_ptr,
    hs_ptr,
    vn_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), B·H)``: each chunk's starting state ``[B, H, NT, K, V]``, ``V'``
    ``[B, T, H, V]`` (both in their outputs' dtype: float32 for the backward, else the input
    dtype) and the final states ``[B·R, H, K, V]`` (float32) of one (V block, batch row, head).
    The state is float32; its products take the input dtype's operands."""
    i_b, i_h, i_bh, o_k, o_v, o_c, m_k, m_v, m_kv, o_kv, row0 = walk_tiles(H, NT, K, V, C, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(NT):
        first, last, state = chunk_flags(flags_ptr, i_n, i_b, i_h, R, H, K, V)
        b_init = tl.load(init_ptr + state + o_kv, mask=m_kv & first, other=0.0)
        b_h = tl.where(first, b_init, b_h)
        p_h = hs_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V + o_kv
        tl.store(p_h, b_h.to(hs_ptr.dtype.element_ty), mask=m_kv)
        rows = row0 + (i_n * C + o_c) * H
        p_k = rows[:, None] * K + o_k[None, :]
        p_v = rows[:, None] * V + o_v[None, :]
        b_w = tl.load(w_ptr + p_k, mask=m_k[None, :], other=0.0)
        b_kg = tl.load(kg_ptr + p_k, mask=m_k[None, :], other=0.0)
        b_u = tl.load(u_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PRECISION)
        tl.store(vn_ptr + p_v, b_vn.to(vn_ptr.dtype.element_ty), mask=m_v[None, :])
        d_row = (i_b.to(tl.int64) * NT + i_n) * H + i_h
        if GK == 1:
            b_h = b_h * tl.load(decay_ptr + d_row)
        else:
            b_h = b_h * tl.load(decay_ptr + d_row * K + o_k, mask=m_k, other=0.0)[:, None]
        b_h += tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype), input_precision=DOT_PRECISION)
        b_h = tl.where(m_k[:, None], b_h, 0.0)  # padding rows stay 0 (a NaN row: 0 · NaN)
        tl.store(final_ptr + state + o_kv, b_h, mask=m_kv & last)


@triton.jit
def kda_fwd_o_kernel(
    qg_ptr,
    p_ptr,
    hs_ptr,
    vn_ptr,
    NT,
    H,
    o_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, cdiv(V, BV), B·H)``: one chunk's outputs ``o = (q ⊙ exp(G)) S + P V'``
    ``[B, T, H, V]`` for a V block, from its starting state ``S`` and ``V'``."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + o_c) * H
    p_v = rows[:, None] * V + o_v[None, :]
    b_qg = tl.load(qg_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    p_h = hs_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vn = tl.load(vn_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
    b_p = tl.load(p_ptr + rows[:, None] * C + o_c[None, :])
    # P V' multiplies the zeros above P's diagonal too: NaN rows enter it as zeros, and each
    # channel's outputs are NaN from its first NaN row on
    nan_v = b_vn != b_vn
    poisoned = tl.cumsum(nan_v.to(tl.int32), axis=0) > 0
    b_o = tl.dot(b_qg, b_h.to(b_qg.dtype), input_precision=DOT_PRECISION)
    b_o += tl.dot(b_p, tl.where(nan_v, 0.0, b_vn), input_precision=DOT_PRECISION)
    b_o = tl.where(poisoned, float("nan"), b_o)
    tl.store(o_ptr + p_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v[None, :])
