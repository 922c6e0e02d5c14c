"""Triton chunked gated delta rule, backward (the layout, flags and notation of
:mod:`ejkernel_triton.kernels.kda_fwd`; signatures in jax-triton's order).

Per chunk the forward computed ``V' = U − W S``, ``o = Q̃ S + P V'`` and
``S_next = diag(γ) S + K̃ᵀ V'`` from the chunk-local ``Q̃ = q ⊙ exp(G)``,
``K̃ = k ⊙ exp(G_C − G)``, ``W``, ``U``, ``P`` and ``γ = exp(G_C)``, with ``S`` the state at the
chunk start; the differentiated forward keeps ``S`` (``[B, H, NT, K, V]``), ``V'``
(``[B, T, H, V]``), ``T`` and the decayed ``K Kᵀ`` (``[B, T, H, C]``), all float32.

- :func:`kda_bwd_dvl_kernel`, one program per (chunk, V block, batch row, head): ``Pᵀ do``.
- :func:`kda_bwd_dh_kernel` walks the chunks of one (V block, batch row, head) from the last,
  carrying ``dS [K, BV]``, the gradient of the state at the end of the current chunk (restarted
  from the final state's cotangent where a sequence ends): it stores ``dS`` per chunk and
  ``dV' = Pᵀ do + K̃ dS``, then ``dS ← diag(γ) dS + Q̃ᵀ do − Wᵀ dV'``; what reaches a
  sequence's first chunk is the initial state's gradient.
- :func:`kda_bwd_dv_kernel`, one program per (chunk, batch row, head), takes over the V
  blocks ``dQ̃ = do Sᵀ``, ``dW = −dV' Sᵀ``, ``dK̃ = V' dSᵀ``, ``dP = do V'ᵀ``,
  ``dγ = Σ_v S ⊙ dS`` and, through ``U = T diag(β) v``, ``dv`` and the values' parts of
  ``dβ`` and ``dT``.
- :func:`kda_bwd_chunk_kernel`, one program per (chunk, batch row, head), recomputes the
  chunk's inputs (:mod:`ejkernel_triton.kernels.kda_common`), reads the forward's ``T`` and
  decayed ``K Kᵀ`` and pulls the rest back to the inputs:
  ``W = T diag(β) (k ⊙ exp(G))``, ``dA = −Tᵀ dT Tᵀ`` (strictly lower),
  ``A = diag(β) (K Kᵀ)_decayed``, the decayed products' own VJP
  (:func:`~ejkernel_triton.kernels.kda_common.decayed_products_bwd`), the cumulative gate
  (a reverse cumulative sum inside the chunk; the floor passes no gradient), the query scale
  and the L2 norms; for a per-head gate. A per-channel gate's chunk pass holds too many
  ``[C, K]`` tiles for one program and is three launches: :func:`kda_bwd_chunk_in_kernel`
  (through the inverse), :func:`kda_bwd_products_kernel` (the decayed products' VJP over
  blocks of key channels, each channel's decays being its own) and
  :func:`kda_bwd_chunk_out_kernel` (the gradients' last steps).

Everything is float32 inside. Tokens the forward entered zeroed (a non-finite key, ``β`` or
gate) get zero gradients for key, value, ``β`` and gate.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.channel_products import DIAGONAL_PRODUCT_SPAN
from ejkernel_triton.kernels.kda_common import (
    SUB,
    chunk_flags,
    chunk_inputs,
    chunk_tiles,
    decayed_products_bwd,
    finite,
    l2_normalise,
    l2_normalise_bwd,
    walk_tiles,
)


@triton.jit
def kda_bwd_dvl_kernel(
    p_ptr,
    do_ptr,
    NT,
    H,
    dvl_ptr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, cdiv(V, BV), B·H)``: ``Pᵀ do`` ``[B, T, H, V]`` (float32), the part of ``dV'``
    that does not depend on the state."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + o_c) * H
    p_v = rows[:, None] * V + o_v[None, :]
    b_p = tl.load(p_ptr + rows[:, None] * C + o_c[None, :])
    b_do = tl.load(do_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
    b_dvl = tl.dot(tl.trans(b_p), b_do, input_precision=DOT_PRECISION)
    tl.store(dvl_ptr + p_v, b_dvl, mask=m_v[None, :])


@triton.jit
def kda_bwd_dh_kernel(
    qg_ptr,
    kg_ptr,
    w_ptr,
    dvl_ptr,
    decay_ptr,
    do_ptr,
    dfinal_ptr,
    flags_ptr,
    NT,
    H,
    R,
    dh_ptr,
    dvn_ptr,
    dinit_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), B·H)``: the chunk-end state gradients ``dh [B, H, NT, K, V]``,
    ``dV' [B, T, H, V]`` and the initial states' gradients ``[B·R, H, K, V]`` (float32), from
    :func:`kda_bwd_dvl_kernel`'s ``Pᵀ do``. ``dS`` is float32; its products take the input
    dtype's operands."""
    i_b, i_h, i_bh, o_k, o_v, o_c, m_k, m_v, m_kv, o_kv, row0 = walk_tiles(H, NT, K, V, C, BK, BV)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for i_m in range(NT):
        i_n = NT - 1 - i_m
        first, last, state = chunk_flags(flags_ptr, i_n, i_b, i_h, R, H, K, V)
        b_dfinal = tl.load(dfinal_ptr + state + o_kv, mask=m_kv & last, other=0.0)
        b_dh = tl.where(last, b_dfinal, b_dh)
        p_dh = dh_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V + o_kv
        tl.store(p_dh, b_dh.to(dh_ptr.dtype.element_ty), mask=m_kv)
        rows = row0 + (i_n * C + o_c) * H
        p_k = rows[:, None] * K + o_k[None, :]
        b_qg = tl.load(qg_ptr + p_k, mask=m_k[None, :], other=0.0)
        b_kg = tl.load(kg_ptr + p_k, mask=m_k[None, :], other=0.0)
        b_w = tl.load(w_ptr + p_k, mask=m_k[None, :], other=0.0)
        p_v = rows[:, None] * V + o_v[None, :]
        b_do = tl.load(do_ptr + p_v, mask=m_v[None, :], other=0.0).to(b_qg.dtype)
        b_dvn = tl.load(dvl_ptr + p_v, mask=m_v[None, :], other=0.0)
        b_dvn += tl.dot(b_kg, b_dh.to(b_kg.dtype), input_precision=DOT_PRECISION)
        tl.store(dvn_ptr + p_v, b_dvn, mask=m_v[None, :])
        d_row = (i_b.to(tl.int64) * NT + i_n) * H + i_h
        if GK == 1:
            b_dh = b_dh * tl.load(decay_ptr + d_row)
        else:
            b_dh = b_dh * tl.load(decay_ptr + d_row * K + o_k, mask=m_k, other=0.0)[:, None]
        b_dh += tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PRECISION)
        b_dh -= tl.dot(tl.trans(b_w), b_dvn.to(b_w.dtype), input_precision=DOT_PRECISION)
        tl.store(dinit_ptr + state + o_kv, b_dh, mask=m_kv & first)


@triton.jit
def kda_bwd_dv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    hs_ptr,
    vn_ptr,
    dh_ptr,
    do_ptr,
    dvn_ptr,
    NT,
    H,
    dv_ptr,
    dqg_ptr,
    dw_ptr,
    dkg_ptr,
    dpt_ptr,
    dt_ptr,
    dbeta_ptr,
    ddecay_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``: what one chunk's gradients take from the values and states, over
    the V blocks: ``dv`` ``[B, T, H, V]`` (the value dtype), and for
    :func:`kda_bwd_chunk_kernel` (float32) ``dQ̃``, ``dW``, ``dK̃`` ``[B, T, H, K]``, ``dPᵀ``
    and the values' part of ``dT`` ``[B, T, H, C]``, their part of ``dβ`` ``[B, T, H]`` and the
    chunk decay's gradient ``[B, NT, H, K]``."""
    o_c, o_k, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    p_c = rows[:, None] * C + o_c[None, :]
    _, _, b_beta, _, bad, _ = chunk_inputs(
        q_ptr, k_ptr, beta_ptr, g_ptr, rows, p_k, m_k, GK, GATE_FLOOR
    )
    b_t = tl.load(t_ptr + p_c)
    b_dqg = tl.zeros([C, BK], dtype=tl.float32)
    b_dw = tl.zeros([C, BK], dtype=tl.float32)
    b_dkg = tl.zeros([C, BK], dtype=tl.float32)
    b_dpt = tl.zeros([C, C], dtype=tl.float32)  # dPᵀ
    b_dt = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    b_ddecay = tl.zeros([BK], dtype=tl.float32)
    state = (tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)) * K * V  # [B, H, NT, K, V]
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        o_kv = o_k[:, None] * V + o_v[None, :]
        p_v = rows[:, None] * V + o_v[None, :]
        b_s = tl.load(hs_ptr + state + o_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_ds = tl.load(dh_ptr + state + o_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_v = tl.where(finite(b_v) & ~bad[:, None], b_v, 0.0)
        b_do = tl.load(do_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_dvn = tl.load(dvn_ptr + p_v, mask=m_v[None, :], other=0.0)
        b_vn = tl.load(vn_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_dqg += tl.dot(b_do, tl.trans(b_s), input_precision=DOT_PRECISION)
        b_dw -= tl.dot(b_dvn, tl.trans(b_s), input_precision=DOT_PRECISION)
        b_dkg += tl.dot(b_vn, tl.trans(b_ds), input_precision=DOT_PRECISION)
        b_dpt += tl.dot(b_vn, tl.trans(b_do), input_precision=DOT_PRECISION)
        b_ddecay += tl.sum(b_s * b_ds, axis=1)
        # U = T diag(β) v
        b_tdu = tl.dot(tl.trans(b_t), b_dvn, input_precision=DOT_PRECISION)
        b_dv = tl.where(bad[:, None], 0.0, b_beta[:, None] * b_tdu)
        tl.store(dv_ptr + p_v, b_dv.to(dv_ptr.dtype.element_ty), mask=m_v[None, :])
        b_dbeta += tl.sum(b_v * b_tdu, axis=1)
        b_dt += tl.dot(b_dvn, tl.trans(b_beta[:, None] * b_v), input_precision=DOT_PRECISION)
    tl.store(dqg_ptr + p_k, b_dqg, mask=m_k[None, :])
    tl.store(dw_ptr + p_k, b_dw, mask=m_k[None, :])
    tl.store(dkg_ptr + p_k, b_dkg, mask=m_k[None, :])
    tl.store(dpt_ptr + p_c, b_dpt)
    tl.store(dt_ptr + p_c, b_dt)
    tl.store(dbeta_ptr + rows, b_dbeta)
    tl.store(ddecay_ptr + slot * K + o_k, b_ddecay, mask=m_k)


@triton.jit
def _chunk_inputs_bwd(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    scale,
    rows,
    p_k,
    m_k,
    o_c,
    C: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
):
    """A chunk's inputs as the forward used them: normalised ``q``, ``k`` and their norms (ones
    without ``L2NORM``), the scaled query, ``β``, ``bad``, ``live``, the cumulative gate ``G``,
    ``G_C``, ``Γ = exp(G)`` and ``exp(G_C − G)``."""
    b_q, b_k, b_beta, b_g, bad, live = chunk_inputs(
        q_ptr, k_ptr, beta_ptr, g_ptr, rows, p_k, m_k, GK, GATE_FLOOR
    )
    if L2NORM:
        b_qn, n_q = l2_normalise(b_q)
        b_kn, n_k = l2_normalise(b_k)
    else:
        b_qn, b_kn = b_q, b_k
        n_q = tl.full([C], 1.0, tl.float32)
        n_k = n_q
    b_gc = tl.cumsum(b_g, axis=0)
    if GK == 1:
        b_glast = tl.sum(tl.where(o_c == C - 1, b_gc, 0.0), axis=0)
        b_gamma = tl.exp(b_gc)[:, None]
        b_to_end = tl.exp(b_glast - b_gc)[:, None]
    else:
        b_glast = tl.sum(tl.where(o_c[:, None] == C - 1, b_gc, 0.0), axis=0)
        b_gamma = tl.exp(b_gc)
        b_to_end = tl.exp(b_glast[None, :] - b_gc)
    return b_qn, n_q, b_kn, n_k, b_qn * scale, b_beta, bad, live, b_gc, b_glast, b_gamma, b_to_end


@triton.jit
def _through_the_inverse(ins, ptrs, at, DOT_PRECISION: tl.constexpr):
    """Through ``W = T diag(β) (k ⊙ Γ)`` and ``T = (I + A)⁻¹`` with
    ``A = diag(β) (K Kᵀ)_decayed`` below the diagonal: the key's and the cumulative gate's
    parts so far ``[C, BK]``, ``dβ`` and ``dM = diag(β) dA`` (the decayed ``K Kᵀ``'s).
    ``ins`` is what :func:`_chunk_inputs_bwd` returned, ``ptrs`` the pointers
    ``(T, K Kᵀ, dW, dT, dβ so far)``, ``at`` the chunk's indices ``(rows, p_k, p_c, m_k, o_c)``."""
    _, _, b_kn, _, _, b_beta, _, _, _, _, b_gamma, _ = ins
    t_ptr, kk_ptr, dw_ptr, dt_ptr, dbeta_v_ptr = ptrs
    rows, p_k, p_c, m_k, o_c = at
    b_kbg = b_beta[:, None] * b_kn * b_gamma
    b_t = tl.load(t_ptr + p_c)
    b_dw = tl.load(dw_ptr + p_k, mask=m_k[None, :], other=0.0)
    b_dt = tl.load(dt_ptr + p_c)
    b_dt += tl.dot(b_dw, tl.trans(b_kbg), input_precision=DOT_PRECISION)
    b_tdw = tl.dot(tl.trans(b_t), b_dw, input_precision=DOT_PRECISION)
    b_dbeta = tl.load(dbeta_v_ptr + rows) + tl.sum(b_kn * b_gamma * b_tdw, axis=1)
    b_dkn = b_beta[:, None] * b_gamma * b_tdw
    b_dgc = b_kbg * b_tdw
    b_da = tl.dot(b_dt, tl.trans(b_t), input_precision=DOT_PRECISION)
    b_da = -tl.dot(tl.trans(b_t), b_da, input_precision=DOT_PRECISION)
    b_da = tl.where(o_c[:, None] > o_c[None, :], b_da, 0.0)
    b_dbeta += tl.sum(b_da * tl.load(kk_ptr + p_c), axis=1)
    return b_dkn, b_dgc, b_dbeta, b_beta[:, None] * b_da


@triton.jit
def _chunk_grads_out(
    b_dqs,
    b_dkn,
    b_dgc,
    ins,
    ptrs,
    at,
    scale,
    C: tl.constexpr,
    K: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """Through ``Q̃ = q ⊙ Γ``, ``K̃ = k ⊙ exp(G_C − G)``, ``γ = exp(G_C)``, the cumulative gate
    (a reverse cumulative sum inside the chunk; the floor passes no gradient), the query scale
    and the L2 norms: store ``dq``, ``dk`` and ``dg``. ``ins`` is what
    :func:`_chunk_inputs_bwd` returned, ``ptrs`` the pointers ``(dQ̃, dK̃, dγ, dq, dk, dg)``, ``at``
    the chunk's indices ``(rows, p_k, m_k, o_c, o_k, slot)``."""
    b_qn, n_q, b_kn, n_k, b_qs, _, bad, live, _, b_glast, b_gamma, b_to_end = ins
    dqg_ptr, dkg_ptr, ddecay_ptr, dq_ptr, dk_ptr, dg_ptr = ptrs
    rows, p_k, m_k, o_c, o_k, slot = at
    # the query's side, the key's, then the gate's: each stored as soon as it is final, which
    # keeps few [C, BK] tiles live at once
    b_dqg = tl.load(dqg_ptr + p_k, mask=m_k[None, :], other=0.0)
    b_dgq = b_dqg * b_qs * b_gamma
    b_dqn = (b_dqs + b_dqg * b_gamma) * scale
    if L2NORM:
        b_dqn = l2_normalise_bwd(b_qn, n_q, b_dqn)
    tl.store(dq_ptr + p_k, b_dqn.to(dq_ptr.dtype.element_ty), mask=m_k[None, :])
    b_dkg = tl.load(dkg_ptr + p_k, mask=m_k[None, :], other=0.0)
    b_kg = b_kn * b_to_end
    b_dkn += b_dkg * b_to_end
    if L2NORM:
        b_dkn = l2_normalise_bwd(b_kn, n_k, b_dkn)
    b_dkn = tl.where(bad[:, None], 0.0, b_dkn)
    tl.store(dk_ptr + p_k, b_dkn.to(dk_ptr.dtype.element_ty), mask=m_k[None, :])
    b_dkk = b_dkg * b_kg
    b_dgc += b_dgq - b_dkk
    b_ddecay = tl.load(ddecay_ptr + slot * K + o_k, mask=m_k, other=0.0)
    b_dglast = tl.sum(b_dkk, axis=0) + b_ddecay * tl.exp(b_glast)  # [BK]
    # dg_s = Σ_{t ≥ s} dG_t: a reverse cumulative sum over the chunk's tokens
    is_last = o_c == C - 1
    if GK == 1:
        b_dgt = tl.sum(b_dgc, axis=1) + tl.where(is_last, tl.sum(b_dglast, axis=0), 0.0)
        b_dg = tl.cumsum(b_dgt, axis=0, reverse=True)
        b_dg = tl.where(live, b_dg, 0.0)
        tl.store(dg_ptr + rows, b_dg)
    else:
        b_dgc += tl.where(is_last[:, None], b_dglast[None, :], 0.0)
        b_dg = tl.cumsum(b_dgc, axis=0, reverse=True)
        b_dg = tl.where(live, b_dg, 0.0)
        tl.store(dg_ptr + p_k, b_dg, mask=m_k[None, :])


@triton.jit
def kda_bwd_chunk_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    kk_ptr,
    dqg_ptr,
    dw_ptr,
    dkg_ptr,
    dpt_ptr,
    dt_ptr,
    dbeta_v_ptr,
    ddecay_ptr,
    scale,
    NT,
    H,
    dq_ptr,
    dk_ptr,
    dbeta_ptr,
    dg_ptr,
    scratch_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``: one chunk's ``dq``, ``dk`` ``[B, T, H, K]`` (the input dtypes),
    ``dβ [B, T, H]`` and ``dg [B, T, H, GK]`` (float32), from :func:`kda_bwd_dv_kernel`'s
    partial gradients and the forward's ``T`` and decayed ``K Kᵀ``, all in one program: a
    per-head gate (``GK = 1``) only. A per-channel gate's backward holds too many ``[C, K]``
    tiles for one program and takes :func:`kda_bwd_chunk_in_kernel`,
    :func:`kda_bwd_products_kernel` (over blocks of key channels) and
    :func:`kda_bwd_chunk_out_kernel`.

    ``scratch [B, NT, H, C²]`` (float32) holds the chunk's ``dM`` between the ``tl.dot`` that
    makes it and those that read it in both orientations (Triton 3.6 cannot lower such a
    product, transposed, as an operand of the next ``tl.dot`` on sm_90 here, so it goes
    through memory, the program's own, read back after a barrier); ``dP`` comes from memory
    for the same reason."""
    o_c, o_k, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    p_c = rows[:, None] * C + o_c[None, :]
    ins = _chunk_inputs_bwd(
        q_ptr, k_ptr, beta_ptr, g_ptr, scale, rows, p_k, m_k, o_c, C, GK, L2NORM, GATE_FLOOR
    )
    _, _, b_kn, _, b_qs, _, bad, _, b_gc, _, _, _ = ins
    b_dkn, b_dgc, b_dbeta, b_dm = _through_the_inverse(
        ins, (t_ptr, kk_ptr, dw_ptr, dt_ptr, dbeta_v_ptr), (rows, p_k, p_c, m_k, o_c), DOT_PRECISION
    )
    tl.store(dbeta_ptr + rows, tl.where(bad, 0.0, b_dbeta))
    tl.static_assert(GK == 1, "a per-channel gate takes the split chunk pass")
    scratch = scratch_ptr + slot * C * C
    tl.store(scratch + o_c[:, None] * C + o_c[None, :], b_dm)
    tl.debug_barrier()
    b_dqs, b_dka, b_dkb = decayed_products_bwd(
        dpt_ptr + rows * C, scratch, b_qs, b_kn, b_gc, o_c, C, DOT_PRECISION
    )
    b_dkn += b_dka + b_dkb
    b_dgc += b_qs * b_dqs + b_kn * (b_dka - b_dkb)
    ptrs = (dqg_ptr, dkg_ptr, ddecay_ptr, dq_ptr, dk_ptr, dg_ptr)
    at = (rows, p_k, m_k, o_c, o_k, slot)
    _chunk_grads_out(b_dqs, b_dkn, b_dgc, ins, ptrs, at, scale, C, K, GK, L2NORM)


@triton.jit
def kda_bwd_chunk_in_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    kk_ptr,
    dw_ptr,
    dt_ptr,
    dbeta_v_ptr,
    scale,
    NT,
    H,
    qs_ptr,
    kn_ptr,
    gc_ptr,
    dkn_ptr,
    dgc_ptr,
    dm_ptr,
    dbeta_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``, a per-channel gate: what :func:`kda_bwd_products_kernel` reads, the
    scaled query, the key and ``G`` as the forward used them and ``dM`` (``[B, NT, H, C, C]``,
    each chunk's contiguous); the parts of the key's and the gate's gradients so far (all
    float32), and ``dβ``."""
    o_c, _, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    p_c = rows[:, None] * C + o_c[None, :]
    ins = _chunk_inputs_bwd(
        q_ptr, k_ptr, beta_ptr, g_ptr, scale, rows, p_k, m_k, o_c, C, GK, L2NORM, GATE_FLOOR
    )
    _, _, b_kn, _, b_qs, _, bad, _, b_gc, _, _, _ = ins
    b_dkn, b_dgc, b_dbeta, b_dm = _through_the_inverse(
        ins, (t_ptr, kk_ptr, dw_ptr, dt_ptr, dbeta_v_ptr), (rows, p_k, p_c, m_k, o_c), DOT_PRECISION
    )
    tl.store(dbeta_ptr + rows, tl.where(bad, 0.0, b_dbeta))
    tl.store(dm_ptr + slot * C * C + o_c[:, None] * C + o_c[None, :], b_dm)
    tl.store(qs_ptr + p_k, b_qs, mask=m_k[None, :])
    tl.store(kn_ptr + p_k, b_kn, mask=m_k[None, :])
    tl.store(gc_ptr + p_k, b_gc, mask=m_k[None, :])
    tl.store(dkn_ptr + p_k, b_dkn, mask=m_k[None, :])
    tl.store(dgc_ptr + p_k, b_dgc, mask=m_k[None, :])


@triton.jit
def kda_bwd_products_kernel(
    qs_ptr,
    kn_ptr,
    gc_ptr,
    dkn_ptr,
    dgc_ptr,
    dpt_ptr,
    dm_ptr,
    NT,
    H,
    dqs_ptr,
    dkn_out_ptr,
    dgc_out_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT · C / SUB, cdiv(K, BKS), B·H)``, a per-channel gate: the decayed products'
    VJP for one block of :data:`SUB` rows of a chunk on ``BKS`` key channels (each channel's
    decays are its own), in :func:`~ejkernel_triton.kernels.kda_fwd.kda_fwd_intra_kernel`'s
    tiles: the query's part ``[B, T, H, K]`` and the key's and gate's gradients so far plus
    the products' (float32).

    With ``D(a, b)_tj = Σ_κ a_tκ b_jκ exp(G_tκ − G_jκ)`` (``j ≤ t``), ``P = D(q, k)`` and
    ``M = D(k, k)``: the block's rows take ``dq_t = Σ_j dP_tj k_j e_tj`` and
    ``dk_t += Σ_j dM_tj k_j e_tj`` from the columns before them, and as columns
    ``dk_j += Σ_t (dP_tj q_t + dM_tj k_t) e_tj`` from the rows after them. Against another
    block the decays factor through the later block's first row (both factors at most 1), on
    the diagonal block they are taken entry by entry. ``dP_tj`` is at ``dpt[j]·C + t`` (each
    token's row of ``dPᵀ``), ``dM_tj`` at ``dm + t·C + j`` (the chunk's ``[C, C]``)."""
    i_ni, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_i = i_ni // (C // SUB), i_ni % (C // SUB)
    i_b, i_h = i_bh // H, i_bh % H
    o_s = tl.arange(0, SUB)
    o_k = i_k * BKS + tl.arange(0, BKS)
    m_k = (o_k < K)[None, :]
    first = i_b.to(tl.int64) * NT * C * H + i_h + i_n * C * H  # the chunk's first token
    dm = dm_ptr + ((i_b.to(tl.int64) * NT + i_n) * H + i_h) * C * C
    t_i = i_i * SUB + o_s  # the block's rows in the chunk
    rows_i = first + t_i * H
    p_i = rows_i[:, None] * K + o_k[None, :]
    b_q = tl.load(qs_ptr + p_i, mask=m_k, other=0.0)
    b_k = tl.load(kn_ptr + p_i, mask=m_k, other=0.0)
    b_g = tl.load(gc_ptr + p_i, mask=m_k, other=0.0)
    # the rows against the earlier blocks' columns, through the block's first row
    b_gr = tl.load(gc_ptr + (first + i_i * SUB * H) * K + o_k, mask=o_k < K, other=0.0)
    b_gr = b_gr[None, :]
    b_dq = tl.zeros([SUB, BKS], dtype=tl.float32)
    b_dka = tl.zeros([SUB, BKS], dtype=tl.float32)
    for jb in range(0, i_i):
        t_j = jb * SUB + o_s
        p_j = (first + t_j * H)[:, None] * K + o_k[None, :]
        b_gj = tl.load(gc_ptr + p_j, mask=m_k, other=0.0)
        b_kb = tl.load(kn_ptr + p_j, mask=m_k, other=0.0) * tl.exp(b_gr - b_gj)
        b_dp = tl.load(dpt_ptr + (first + t_j * H)[None, :] * C + t_i[:, None])
        b_dm = tl.load(dm + t_i[:, None] * C + t_j[None, :])
        b_dq += tl.dot(b_dp, b_kb, input_precision=DOT_PRECISION)
        b_dka += tl.dot(b_dm, b_kb, input_precision=DOT_PRECISION)
    b_in = tl.exp(b_g - b_gr)
    b_dq *= b_in
    b_dka *= b_in
    # the diagonal block: through its first row where the channels' decay span allows it
    # (see gla_fwd.DIAGONAL_PRODUCT_SPAN), as a column of the rows t ≥ s and as a row of the
    # columns r ≤ s; otherwise one token s of it a step
    b_dkb = tl.zeros([SUB, BKS], dtype=tl.float32)
    span = tl.max(b_gr - b_g)
    if span <= DIAGONAL_PRODUCT_SPAN:
        t_s = i_i * SUB + o_s
        lower = o_s[:, None] >= o_s[None, :]  # [t, s]: s ≤ t
        b_dpd = tl.load(dpt_ptr + rows_i[None, :] * C + t_s[:, None], mask=lower, other=0.0)
        b_dmd = tl.load(dm + t_s[:, None] * C + t_s[None, :], mask=lower, other=0.0)
        b_kout = b_k * tl.exp(b_gr - b_g)
        b_dq += b_in * tl.dot(b_dpd, b_kout, input_precision=DOT_PRECISION)
        b_dka += b_in * tl.dot(b_dmd, b_kout, input_precision=DOT_PRECISION)
        upper = o_s[:, None] <= o_s[None, :]  # [r, s]: r ≤ s
        b_dpu = tl.load(dpt_ptr + rows_i[:, None] * C + t_s[None, :], mask=upper, other=0.0)
        b_dmu = tl.load(dm + t_s[None, :] * C + t_s[:, None], mask=upper, other=0.0)
        b_sum = tl.dot(b_dpu, b_q * b_in, input_precision=DOT_PRECISION)
        b_sum += tl.dot(b_dmu, b_k * b_in, input_precision=DOT_PRECISION)
        b_dkb += tl.exp(b_gr - b_g) * b_sum
    else:
        for s in range(0, SUB):
            row_s = first + (i_i * SUB + s) * H
            b_ks = tl.load(kn_ptr + row_s * K + o_k, mask=o_k < K, other=0.0)[None, :]
            b_gs = tl.load(gc_ptr + row_s * K + o_k, mask=o_k < K, other=0.0)[None, :]
            b_qs = tl.load(qs_ptr + row_s * K + o_k, mask=o_k < K, other=0.0)[None, :]
            after = o_s >= s
            b_dpc = tl.load(dpt_ptr + row_s * C + t_i, mask=after, other=0.0)[:, None]
            b_dmc = tl.load(dm + t_i * C + i_i * SUB + s, mask=after, other=0.0)[:, None]
            b_e = tl.exp(tl.where(after[:, None], b_g - b_gs, float("-inf")))
            b_dq += b_dpc * b_ks * b_e
            b_dka += b_dmc * b_ks * b_e
            before = o_s <= s
            b_dpr = tl.load(dpt_ptr + rows_i * C + i_i * SUB + s, mask=before, other=0.0)[:, None]
            b_dmr = tl.load(dm + (i_i * SUB + s) * C + t_i, mask=before, other=0.0)[:, None]
            b_e = tl.exp(tl.where(before[:, None], b_gs - b_g, float("-inf")))
            b_dkb += (b_dpr * b_qs + b_dmr * b_ks) * b_e
    # the block's columns against the later blocks' rows, through each one's first row
    for tb in range(i_i + 1, C // SUB):
        t_t = tb * SUB + o_s
        rows_t = first + t_t * H
        p_t = rows_t[:, None] * K + o_k[None, :]
        b_gt0 = tl.load(gc_ptr + (first + tb * SUB * H) * K + o_k, mask=o_k < K, other=0.0)
        b_gt0 = b_gt0[None, :]
        b_et = tl.exp(tl.load(gc_ptr + p_t, mask=m_k, other=0.0) - b_gt0)
        b_qt = tl.load(qs_ptr + p_t, mask=m_k, other=0.0) * b_et
        b_kt = tl.load(kn_ptr + p_t, mask=m_k, other=0.0) * b_et
        b_dpt = tl.load(dpt_ptr + rows_i[:, None] * C + t_t[None, :])
        b_dmt = tl.load(dm + t_t[None, :] * C + t_i[:, None])
        b_sum = tl.dot(b_dpt, b_qt, input_precision=DOT_PRECISION)
        b_sum += tl.dot(b_dmt, b_kt, input_precision=DOT_PRECISION)
        b_dkb += tl.exp(b_gt0 - b_g) * b_sum
    b_dkn = tl.load(dkn_ptr + p_i, mask=m_k, other=0.0) + b_dka + b_dkb
    b_dgc = tl.load(dgc_ptr + p_i, mask=m_k, other=0.0)
    b_dgc += b_q * b_dq + b_k * (b_dka - b_dkb)
    tl.store(dqs_ptr + p_i, b_dq, mask=m_k)
    tl.store(dkn_out_ptr + p_i, b_dkn, mask=m_k)
    tl.store(dgc_out_ptr + p_i, b_dgc, mask=m_k)


@triton.jit
def kda_bwd_chunk_out_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    dqs_ptr,
    dkn_ptr,
    dgc_ptr,
    dqg_ptr,
    dkg_ptr,
    ddecay_ptr,
    scale,
    NT,
    H,
    dq_ptr,
    dk_ptr,
    dg_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
):
    """Grid ``(NT, B·H)``, a per-channel gate: ``dq``, ``dk`` (the input dtypes) and ``dg``
    (float32) from :func:`kda_bwd_products_kernel`'s parts."""
    o_c, o_k, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    ins = _chunk_inputs_bwd(
        q_ptr, k_ptr, beta_ptr, g_ptr, scale, rows, p_k, m_k, o_c, C, GK, L2NORM, GATE_FLOOR
    )
    ptrs = (dqg_ptr, dkg_ptr, ddecay_ptr, dq_ptr, dk_ptr, dg_ptr)
    at = (rows, p_k, m_k, o_c, o_k, slot)
    b_dqs = tl.load(dqs_ptr + p_k, mask=m_k[None, :], other=0.0)
    b_dkn = tl.load(dkn_ptr + p_k, mask=m_k[None, :], other=0.0)
    b_dgc = tl.load(dgc_ptr + p_k, mask=m_k[None, :], other=0.0)
    _chunk_grads_out(b_dqs, b_dkn, b_dgc, ins, ptrs, at, scale, C, K, GK, L2NORM)


# Left to itself, ptxas gives these kernels 32 registers and spills most of their tiles at
# chunks of 32 (sm_90, CUDA 12.8 and 13.0); the whole register file is the better trade.
kda_bwd_dv_kernel.ejkernel_compile_options = {"maxnreg": 255}
kda_bwd_chunk_kernel.ejkernel_compile_options = {"maxnreg": 255}
kda_bwd_chunk_in_kernel.ejkernel_compile_options = {"maxnreg": 255}
kda_bwd_chunk_out_kernel.ejkernel_compile_options = {"maxnreg": 255}
