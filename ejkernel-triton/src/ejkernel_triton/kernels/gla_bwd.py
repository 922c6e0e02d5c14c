"""Triton chunked gated linear attention, backward (the layout and flags of
:mod:`ejkernel_triton.kernels.gla_fwd`; signatures in jax-triton's order).

- :func:`gla_bwd_dh_kernel` walks the chunks from the last, carrying ``dh [K, V]`` in float32,
  the gradient of the state at the end of the current chunk: it restarts from the final state's
  cotangent where a sequence ends, stores ``dh`` per chunk, then
  ``dh ← dh · exp(G_last)[:, None] + (scale · q ⊙ exp(G))ᵀ do``; what reaches a sequence's first
  chunk is the initial state's gradient. It also writes ``Σ_v h_end ⊙ dh`` per chunk: the
  part of the gate gradient that reaches the chunk's tokens through its end state.
- :func:`gla_bwd_da_kernel`: ``dA = scale · do vᵀ`` on and below the diagonal.
- :func:`gla_bwd_dv_kernel`: ``dv = Aᵀ do + (k ⊙ exp(G_last − G)) dh``.
- :func:`gla_bwd_intra_kernel`: the intra-chunk ``dq_i = Σ_{j≤i} dA_ij k_j ⊙ exp(G_i − G_j)``
  and ``dk_j = Σ_{i≥j} dA_ij q_i ⊙ exp(G_i − G_j)`` a chunk a program, each exponent split at
  the first row of row ``i``'s sub-chunk so both parts are ≤ 0 for decaying gates below the
  diagonal sub-chunks; those take the same split where the decay across them is bounded, and
  go entry by entry, masked before the exp, otherwise.
- :func:`gla_bwd_dqk_kernel`: adds the inter-chunk ``scale · exp(G) ⊙ do hᵀ`` to dq and
  ``exp(G_last − G) ⊙ v dhᵀ`` to dk, and writes the reverse cumulative sum of
  ``q ⊙ dq − k ⊙ dk`` within the chunk (float32): the gate gradient but for what arrives
  through the chunk's end state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.channel_products import (
    DIAGONAL_PRODUCT_SPAN,
    DIAGONAL_PRODUCT_SPAN_F16,
    SUB,
)


@triton.jit
def gla_bwd_dh_kernel(
    q_ptr,
    g_ptr,
    do_ptr,
    h_ptr,
    final_ptr,
    dfinal_ptr,
    flags_ptr,
    scale,
    NT,
    H,
    R,
    dh_ptr,
    dinit_ptr,
    dgs_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), cdiv(V, BV), B·H)``: chunk-end state gradients
    ``dh [B, H, NT, K, V]``, initial-state gradients ``[B·R, H, K, V]`` (float32), and
    ``Σ_v h_end ⊙ dh`` per chunk and V block, ``[B, H, NT, cdiv(V, BV), K]`` (float32): the
    gate gradient that reaches a chunk through its end state (``h_end`` the next chunk's start
    state, or the final state at a sequence's last chunk)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.num_programs(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    row0 = i_b.to(tl.int64) * NT * C * H + i_h
    p_dh = dh_ptr + i_bh.to(tl.int64) * NT * K * V
    p_h = h_ptr + i_bh.to(tl.int64) * NT * K * V
    p_dgs = dgs_ptr + (i_bh.to(tl.int64) * NT * NV + i_v) * K + o_k
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for i_m in range(NT):
        i_n = NT - 1 - i_m
        flags = tl.load(flags_ptr + i_n)
        first, last = (flags & 1) != 0, (flags & 2) != 0
        state = ((i_b * R + (flags >> 2)).to(tl.int64) * H + i_h) * K * V
        b_dfinal = tl.load(dfinal_ptr + state + o_kv, mask=m_kv & last, other=0.0)
        b_dh = tl.where(last, b_dfinal, b_dh)
        tl.store(p_dh + i_n * K * V + o_kv, b_dh.to(dh_ptr.dtype.element_ty), mask=m_kv)
        b_final = tl.load(final_ptr + state + o_kv, mask=m_kv & last, other=0.0)
        m_next = m_kv & ((flags & 2) == 0) & (i_n + 1 < NT)
        b_next = tl.load(p_h + (i_n + 1) * K * V + o_kv, mask=m_next, other=0.0)
        b_end = tl.where(last, b_final, b_next.to(tl.float32))
        tl.store(p_dgs + i_n * NV * K, tl.sum(b_end * b_dh, axis=1), mask=m_k)
        rows = row0 + (i_n * C + o_c) * H
        b_q = tl.load(q_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_g = tl.load(g_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_do = tl.load(do_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_glast = tl.load(g_ptr + (row0 + (i_n * C + C - 1) * H) * K + o_k, mask=m_k, other=0.0)
        b_qg = (b_q * tl.exp(b_g) * scale).to(b_do.dtype)
        b_dh = b_dh * tl.exp(b_glast)[:, None] + tl.dot(
            tl.trans(b_qg), b_do, input_precision=DOT_PRECISION
        )
        tl.store(dinit_ptr + state + o_kv, b_dh, mask=m_kv & first)


@triton.jit
def gla_bwd_da_kernel(
    v_ptr,
    do_ptr,
    scale,
    NT,
    H,
    da_ptr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``: ``dA [C, C]`` of one chunk (float32 ``[B, T, H, C]``, zero above
    the diagonal)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, C)
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + o_c) * H
    b_da = tl.zeros([C, C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        b_do = tl.load(do_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_v = tl.load(v_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_da += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
    b_da = tl.where(o_c[:, None] >= o_c[None, :], b_da * scale, 0.0)
    tl.store(da_ptr + rows[:, None] * C + o_c[None, :], b_da)


@triton.jit
def gla_bwd_dv_kernel(
    k_ptr,
    g_ptr,
    a_ptr,
    do_ptr,
    dh_ptr,
    NT,
    H,
    dv_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), NT, B·H)``: ``dv = Aᵀ do + (k ⊙ exp(G_last − G)) dh``."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < V
    row0 = i_b.to(tl.int64) * NT * C * H + i_h
    rows = row0 + (i_n * C + o_c) * H
    row_last = row0 + (i_n * C + C - 1) * H
    p_dh = dh_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V
    b_do = tl.load(do_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    dt = b_do.dtype
    b_a = tl.load(a_ptr + rows[:, None] * C + o_c[None, :])
    b_dv = tl.dot(tl.trans(b_a).to(dt), b_do, input_precision=DOT_PRECISION)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(k_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_g = tl.load(g_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_glast = tl.load(g_ptr + row_last * K + o_k, mask=m_k, other=0.0)
        b_dh = tl.load(
            p_dh + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0
        )
        b_kd = (b_k * tl.exp(b_glast[None, :] - b_g)).to(dt)
        b_dv += tl.dot(b_kd, b_dh.to(dt), input_precision=DOT_PRECISION)
    tl.store(
        dv_ptr + rows[:, None] * V + o_v[None, :],
        b_dv.to(dv_ptr.dtype.element_ty),
        mask=m_v[None, :],
    )


@triton.jit
def gla_bwd_intra_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    da_ptr,
    NT,
    H,
    dq_ptr,
    dk_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, cdiv(K, BK), B·H)``: the intra-chunk dq and dk (float32 ``[B, T, H, K]``)
    of one chunk on ``BK`` key channels, in whole-chunk tiles factored as the forward's
    (:func:`~ejkernel_triton.kernels.channel_products.channel_products`): with ``ρ(i)`` the
    first row of row ``i``'s block of :data:`SUB` and ``r`` a block,
    ``exp(G_i − G_j) = exp(G_i − G_ρ(i)) exp(G_ρ(i) − G_j)``, so each block ``r`` of ``dA``'s
    rows takes one product against the keys up to it (for dq) and one against its own rows'
    queries (for dk). The diagonal blocks take part where the channels' decay span across any
    block is at most ``DIAGONAL_PRODUCT_SPAN`` (8 for float16 operands), and otherwise go entry
    by entry, one token of every block a step, masked before the exp."""
    i_n, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, C)
    o_s = o_c % SUB
    blk = o_c // SUB
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = (o_k < K)[None, :]
    first = i_b.to(tl.int64) * NT * C * H + i_h + i_n * C * H  # the chunk's first token
    rows = first + o_c * H
    p_k = rows[:, None] * K + o_k[None, :]
    dt = q_ptr.dtype.element_ty
    b_q = tl.load(q_ptr + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g_ptr + p_k, mask=m_k, other=0.0)
    p_ref = (first + blk * SUB * H)[:, None] * K + o_k[None, :]
    b_gref = tl.load(g_ptr + p_ref, mask=m_k, other=0.0)
    b_in = tl.exp(b_g - b_gref)
    b_qa = (b_q * b_in).to(dt)
    limit: tl.constexpr = DIAGONAL_PRODUCT_SPAN_F16 if dt == tl.float16 else DIAGONAL_PRODUCT_SPAN
    diagonal = tl.max(b_gref - b_g) <= limit
    lower = o_c[:, None] >= o_c[None, :]
    b_da = tl.load(da_ptr + rows[:, None] * C + o_c[None, :], mask=lower, other=0.0)  # [i, j]
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    for r in tl.static_range(C // SUB):
        b_gr = tl.load(g_ptr + (first + r * SUB * H) * K + o_k, mask=o_k < K, other=0.0)
        b_gr = tl.where(b_gr == b_gr, b_gr, 0.0)  # a NaN reference: see channel_products
        seen = (blk < r + diagonal.to(tl.int32))[:, None]  # block r itself if diagonal
        b_out = tl.exp(tl.where(seen, b_gr[None, :] - b_g, float("-inf")))
        b_dar = tl.where((blk == r)[:, None], b_da, 0.0).to(dt)
        b_dq += tl.dot(b_dar, (b_k * b_out).to(dt), input_precision=DOT_PRECISION)
        b_dk += b_out * tl.dot(tl.trans(b_dar), b_qa, input_precision=DOT_PRECISION)
    b_dq *= b_in
    if not diagonal:
        for s in range(0, SUB):
            col = blk * SUB + s  # each row's block's token s
            p_s = (first + col * H)[:, None] * K + o_k[None, :]
            b_ks = tl.load(k_ptr + p_s, mask=m_k, other=0.0).to(tl.float32)
            b_qs = tl.load(q_ptr + p_s, mask=m_k, other=0.0).to(tl.float32)
            b_gs = tl.load(g_ptr + p_s, mask=m_k, other=0.0)
            after = o_s >= s  # token s as a column of its block's rows i ≥ s
            b_dac = tl.load(da_ptr + rows * C + col, mask=after, other=0.0)
            b_e = tl.exp(tl.where(after[:, None], b_g - b_gs, float("-inf")))
            b_dq += tl.where(after[:, None], b_dac[:, None] * b_ks * b_e, 0.0)
            before = o_s <= s  # token s as a row of its block's columns j ≤ s
            b_das = tl.load(da_ptr + (first + col * H) * C + o_c, mask=before, other=0.0)
            b_e = tl.exp(tl.where(before[:, None], b_gs - b_g, float("-inf")))
            b_dk += tl.where(before[:, None], b_das[:, None] * b_qs * b_e, 0.0)
    tl.store(dq_ptr + p_k, b_dq, mask=m_k)
    tl.store(dk_ptr + p_k, b_dk, mask=m_k)


@triton.jit
def gla_bwd_dqk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    h_ptr,
    dh_ptr,
    do_ptr,
    dqi_ptr,
    dki_ptr,
    scale,
    NT,
    H,
    dq_ptr,
    dk_ptr,
    dg_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), NT, B·H)``: dq, dk (input dtype) and the in-chunk reverse cumsum of
    ``q ⊙ dq − k ⊙ dk`` (float32) of one chunk."""
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
    o_c = tl.arange(0, C)
    m_k = o_k < K
    row0 = i_b.to(tl.int64) * NT * C * H + i_h
    rows = row0 + (i_n * C + o_c) * H
    state = (i_bh.to(tl.int64) * NT + i_n) * K * V
    dt = q_ptr.dtype.element_ty
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        o_kv = o_k[:, None] * V + o_v[None, :]
        b_do = tl.load(do_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_v = tl.load(v_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_h = tl.load(h_ptr + state + o_kv, mask=m_kv, other=0.0)
        b_dh = tl.load(dh_ptr + state + o_kv, mask=m_kv, other=0.0)
        b_dq += tl.dot(b_do, tl.trans(b_h).to(dt), input_precision=DOT_PRECISION)
        b_dk += tl.dot(b_v, tl.trans(b_dh).to(dt), input_precision=DOT_PRECISION)
    p = rows[:, None] * K + o_k[None, :]
    b_g = tl.load(g_ptr + p, mask=m_k[None, :], other=0.0)
    b_glast = tl.load(g_ptr + (row0 + (i_n * C + C - 1) * H) * K + o_k, mask=m_k, other=0.0)
    b_q = tl.load(q_ptr + p, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + p, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_dq = tl.load(dqi_ptr + p, mask=m_k[None, :], other=0.0) + b_dq * tl.exp(b_g) * scale
    b_dk = tl.load(dki_ptr + p, mask=m_k[None, :], other=0.0) + b_dk * tl.exp(
        b_glast[None, :] - b_g
    )
    tl.store(dq_ptr + p, b_dq.to(dq_ptr.dtype.element_ty), mask=m_k[None, :])
    tl.store(dk_ptr + p, b_dk.to(dk_ptr.dtype.element_ty), mask=m_k[None, :])
    b_dg = tl.cumsum(b_q * b_dq - b_k * b_dk, axis=0, reverse=True)
    tl.store(dg_ptr + p, b_dg, mask=m_k[None, :])
