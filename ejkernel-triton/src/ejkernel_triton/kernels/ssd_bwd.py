"""Triton Mamba-2 SSD, backward: the chunked SSD's gradients with one scalar decay per
(token, head) (Dao and Gu, "Transformers are SSMs", ICML 2024, Sec. 6-7; the forward in
:mod:`ejkernel_triton.kernels.ssd_fwd`, whose layouts and notation these kernels share).

Per chunk, with the chunk-start state ``H₀ = hᵀ`` (the forward's ``[B, H, NT, N, P]``), the
gradient ``dH₁`` of the state at the chunk's end, the output cotangent ``dy`` (of
``y = exp(G) ⊙ (C H₀) + M u``, before the skip and the gate), ``S = C Bᵀ``, the masked decay
``Dᵢⱼ = exp(Gᵢ − Gⱼ)`` (j ≤ i), ``dM = dy uᵀ`` and ``e = exp(G_last − G)``:

- ``dH₀ = exp(G_last) dH₁ + (C ⊙ exp(G))ᵀ dy``,
- ``du = (S ⊙ D)ᵀ dy + (B ⊙ e) dH₁``,
- ``dC = (dM ⊙ D) B + exp(G) ⊙ (dy H₀ᵀ)``, ``dB = (dM ⊙ D)ᵀ C + e ⊙ (u dH₁ᵀ)``,
- the gradient of the chunk-local cumulative log decay, with ``A = dM ⊙ S ⊙ D`` and
  ``w = Σ_p ((B ⊙ e) dH₁) ⊙ u``: ``dG = Σⱼ Aᵢⱼ − Σᵢ Aᵢⱼ + exp(G) ⊙ Σ_p dy ⊙ (C H₀) − w``, and
  the last token's also ``Σ w + exp(G_last) Σ H₀ ⊙ dH₁``. The intra-chunk diagonal cancels
  entry by entry in float32 (no rounding of a product sum in between).

Three kernels:

- :func:`ssd_bwd_dh_kernel` walks the chunks of a (batch row, head) backwards, carrying
  ``dH`` in float32 from the final state's cotangent; it stores ``dH₁`` of every chunk and the
  initial state's gradient.
- :func:`ssd_bwd_dx_kernel`, per chunk and ``P`` block: ``du``, from it ``dx = Δ du + D dy``
  and the block's share of ``dΔ = Σ_p du ⊙ x`` and of ``dG`` (sums over ``P``: the caller adds
  the blocks).
- :func:`ssd_bwd_dbc_kernel`, per chunk and ``N`` block: ``dB`` and ``dC`` of the head (the
  caller sums a group's heads).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.ssd_fwd import (
    causal_decay,
    chunk_program,
    walk_chunk,
    walk_program,
)


@triton.jit
def ssd_bwd_dh_kernel(
    c_ptr,
    dy_ptr,
    g_ptr,
    dfinal_ptr,
    S,
    NT,
    H,
    NG,
    dh_ptr,
    dinit_ptr,
    N: tl.constexpr,
    P: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(N, BK), cdiv(P, BV), B·H)``: the chunk-end state gradients ``dH₁``
    ``[B, H, NT, N, P]`` (``dy``'s dtype) and the initial state's ``[B, H, P, N]`` (float32, the
    op's layout; ``dfinal_ptr`` the final state's cotangent, likewise) of one (N block, P
    block, batch row, head)."""
    i_h, o_k, o_v, m_k, m_v, m_kv, o_kv, o_state, state, p_tiles, tok0, row0 = walk_program(
        S, NT, H, NG, N, P, C, BK, BV
    )
    b_dh = tl.load(dfinal_ptr + state + o_state, mask=m_kv, other=0.0)
    for j in range(NT):
        i_n = NT - 1 - j
        p_dh = dh_ptr + p_tiles + i_n * N * P + o_kv
        tl.store(p_dh, b_dh.to(dh_ptr.dtype.element_ty), mask=m_kv)
        _, m_t, tok, b_ct, b_g, b_glast = walk_chunk(
            c_ptr, g_ptr, i_n, tok0, row0, o_k, m_k, S, H, NG, N, C, i_h
        )
        p_dy = dy_ptr + (tok[:, None] * H + i_h) * P + o_v[None, :]
        b_dy = tl.load(p_dy, mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_qt = (b_ct * tl.exp(b_g)[None, :]).to(b_dy.dtype)
        b_dh = b_dh * tl.exp(b_glast) + tl.dot(b_qt, b_dy, input_precision=DOT_PRECISION)
    tl.store(dinit_ptr + state + o_state, b_dh, mask=m_kv)


@triton.jit
def ssd_bwd_dx_kernel(
    x_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    g_ptr,
    h_ptr,
    dh_ptr,
    dy_ptr,
    d_ptr,
    S,
    NT,
    H,
    NG,
    dx_ptr,
    ddt_ptr,
    dg_ptr,
    N: tl.constexpr,
    P: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(P, BV), NT, B·H)``: ``dx = Δ du + D dy`` (``[B, S, H, P]``, ``x``'s dtype)
    of one chunk and P block, and the block's shares of ``dΔ`` and ``dG``
    (``[B, cdiv(P, BV), T, H]`` float32, every token of the chunk)."""
    i_n, i_b, i_bh, i_h, i_g, o_c, o_t, m_t, tok, b_g, b_dt, b_glast = chunk_program(
        dt_ptr, g_ptr, S, NT, H, NG, C
    )
    i_v = tl.program_id(0)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < P
    m_tv = m_t[:, None] & m_v[None, :]
    p_x = (tok[:, None] * H + i_h) * P + o_v[None, :]
    b_x = tl.load(x_ptr + p_x, mask=m_tv, other=0.0)
    dt = b_x.dtype
    b_u = (b_x.to(tl.float32) * b_dt[:, None]).to(dt)
    b_dy = tl.load(dy_ptr + p_x, mask=m_tv, other=0.0)
    b_e = tl.exp(b_glast - b_g)
    p_h = h_ptr + (i_bh.to(tl.int64) * NT + i_n) * N * P
    p_dh = dh_ptr + (i_bh.to(tl.int64) * NT + i_n) * N * P
    b_s = tl.zeros([C, C], dtype=tl.float32)
    b_ch = tl.zeros([C, BV], dtype=tl.float32)  # C H₀
    b_dui = tl.zeros([C, BV], dtype=tl.float32)  # (B ⊙ e) dH₁
    b_hdh = tl.zeros([BV], dtype=tl.float32)  # Σ_k H₀ ⊙ dH₁
    for k0 in range(0, N, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < N
        p_bc = (tok[:, None] * NG + i_g) * N + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_c = tl.load(c_ptr + p_bc, mask=m_tk, other=0.0)
        b_b = tl.load(b_ptr + p_bc, mask=m_tk, other=0.0)
        o_kv = o_k[:, None] * P + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(p_h + o_kv, mask=m_kv, other=0.0)
        b_dh = tl.load(p_dh + o_kv, mask=m_kv, other=0.0)
        b_s += tl.dot(b_c, tl.trans(b_b), input_precision=DOT_PRECISION)
        b_ch += tl.dot(b_c, b_h.to(dt), input_precision=DOT_PRECISION)
        b_be = (b_b * b_e[:, None]).to(dt)
        b_dui += tl.dot(b_be, b_dh.to(dt), input_precision=DOT_PRECISION)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)
    causal, b_decay = causal_decay(b_g, o_c)
    b_sd = tl.where(causal, b_s * b_decay, 0.0)
    b_du = tl.dot(tl.trans(b_sd).to(dt), b_dy, input_precision=DOT_PRECISION) + b_dui
    b_dyf = b_dy.to(tl.float32)
    b_dx = b_du * b_dt[:, None] + tl.load(d_ptr + i_h) * b_dyf
    tl.store(dx_ptr + p_x, b_dx.to(dx_ptr.dtype.element_ty), mask=m_tv)
    # dG: the intra-chunk term's rows minus its columns, the inter-chunk term, the state update
    b_a = tl.dot(b_dy, tl.trans(b_u), input_precision=DOT_PRECISION) * b_sd
    b_w = tl.sum(b_dui * b_u.to(tl.float32), axis=1)
    b_dg = tl.sum(b_a, axis=1) - tl.sum(b_a, axis=0) - b_w
    b_dg += tl.exp(b_g) * tl.sum(b_dyf * b_ch, axis=1)
    b_last = tl.sum(b_w, axis=0) + tl.exp(b_glast) * tl.sum(b_hdh, axis=0)
    b_dg += tl.where(o_c == C - 1, b_last, 0.0)
    b_ddt = tl.sum(b_du * b_x.to(tl.float32), axis=1)
    share = (i_b.to(tl.int64) * tl.num_programs(0) + i_v) * NT * C * H + i_h + o_t * H
    tl.store(ddt_ptr + share, b_ddt)
    tl.store(dg_ptr + share, b_dg)


@triton.jit
def ssd_bwd_dbc_kernel(
    x_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    g_ptr,
    h_ptr,
    dh_ptr,
    dy_ptr,
    S,
    NT,
    H,
    NG,
    db_ptr,
    dc_ptr,
    N: tl.constexpr,
    P: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(N, BK), NT, B·H)``: ``dB`` and ``dC`` of one chunk, N block and head
    (``[B, S, H, N]``, ``x``'s dtype)."""
    i_n, _, i_bh, i_h, i_g, o_c, _, m_t, tok, b_g, b_dt, b_glast = chunk_program(
        dt_ptr, g_ptr, S, NT, H, NG, C
    )
    o_k = tl.program_id(0) * BK + tl.arange(0, BK)
    m_k = o_k < N
    m_tk = m_t[:, None] & m_k[None, :]
    p_bc = (tok[:, None] * NG + i_g) * N + o_k[None, :]
    b_c = tl.load(c_ptr + p_bc, mask=m_tk, other=0.0)
    b_b = tl.load(b_ptr + p_bc, mask=m_tk, other=0.0)
    dt = b_c.dtype
    p_h = h_ptr + (i_bh.to(tl.int64) * NT + i_n) * N * P
    p_dh = dh_ptr + (i_bh.to(tl.int64) * NT + i_n) * N * P
    b_dm = tl.zeros([C, C], dtype=tl.float32)  # dy uᵀ
    b_dyh = tl.zeros([C, BK], dtype=tl.float32)  # dy H₀ᵀ
    b_udh = tl.zeros([C, BK], dtype=tl.float32)  # u dH₁ᵀ
    for v0 in range(0, P, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < P
        m_tv = m_t[:, None] & m_v[None, :]
        p_x = (tok[:, None] * H + i_h) * P + o_v[None, :]
        b_x = tl.load(x_ptr + p_x, mask=m_tv, other=0.0)
        b_u = (b_x.to(tl.float32) * b_dt[:, None]).to(dt)
        b_dy = tl.load(dy_ptr + p_x, mask=m_tv, other=0.0)
        # H₀ and dH₁ as [BV, BK]: the transposed operands
        o_vk = o_k[None, :] * P + o_v[:, None]
        m_vk = m_v[:, None] & m_k[None, :]
        b_ht = tl.load(p_h + o_vk, mask=m_vk, other=0.0).to(dt)
        b_dht = tl.load(p_dh + o_vk, mask=m_vk, other=0.0).to(dt)
        b_dm += tl.dot(b_dy, tl.trans(b_u), input_precision=DOT_PRECISION)
        b_dyh += tl.dot(b_dy, b_ht, input_precision=DOT_PRECISION)
        b_udh += tl.dot(b_u, b_dht, input_precision=DOT_PRECISION)
    causal, b_decay = causal_decay(b_g, o_c)
    b_dmd = tl.where(causal, b_dm * b_decay, 0.0)
    b_dc = tl.dot(b_dmd.to(dt), b_b, input_precision=DOT_PRECISION)
    b_dc += tl.exp(b_g)[:, None] * b_dyh
    b_db = tl.dot(tl.trans(b_dmd).to(dt), b_c, input_precision=DOT_PRECISION)
    b_db += tl.exp(b_glast - b_g)[:, None] * b_udh
    p_out = (tok[:, None] * H + i_h) * N + o_k[None, :]
    tl.store(db_ptr + p_out, b_db.to(db_ptr.dtype.element_ty), mask=m_tk)
    tl.store(dc_ptr + p_out, b_dc.to(dc_ptr.dtype.element_ty), mask=m_tk)
