"""Triton chunked gated linear attention, forward (GLA, Yang et al., 2024, Sec. 4).

Kernel signatures follow jax-triton's order: inputs (arrays, then scalars), outputs, constexprs.
Every kernel reads the chunk layout :mod:`ejkernel_triton.ops.gla` builds: tokens
``[B, T, H, F]`` with ``T = NT · C`` (each packed sequence starts on a chunk boundary, padding
slots hold zeros), ``G`` the float32 cumulative log gate *within* each chunk (``G[t] = Σ g`` from
the chunk start through ``t``), and one int32 flag word per chunk: ``sid << 2 | last << 1 |
first`` (the chunk's state row, whether it ends and whether it starts its sequence).

Three kernels:

- :func:`gla_fwd_h_kernel` walks the chunks of a (batch row, head) in order, carrying the state
  ``h [K, V]`` in float32: ``h ← h · exp(G_last)[:, None] + (k ⊙ exp(G_last − G))ᵀ v``; it
  stores the state at every chunk start (what the output and the backward read) and each
  sequence's final state, and restarts from the initial state where a sequence begins.
- :func:`gla_fwd_a_kernel` builds the intra-chunk matrix
  ``A[i, j] = scale · Σ_k q_ik k_jk exp(G_ik − G_jk)`` (j ≤ i), one program a chunk
  (:func:`~ejkernel_triton.kernels.channel_products.channel_products`): the decay splits at
  the first row ``r`` of each row's sub-chunk of 16, ``(q ⊙ exp(G − G_r)) (k ⊙ exp(G_r −
  G))ᵀ``, both exponents ≤ 0 below the diagonal sub-chunks; those take the same split where
  the channels' decay across a sub-chunk is bounded and are formed entry by entry from
  ``exp(G_i − G_j)``, masked before the exp, otherwise. No exp sees an unbounded (positive)
  difference of a later and an earlier cumulative decay, so gates down to any log decay give
  no Inf or NaN.
- :func:`gla_fwd_o_kernel`: ``o = scale · (q ⊙ exp(G)) h_chunk + A v``.

A NaN in an input stays in its causal future, as in the recurrence: the masked entries of
``A`` are selected away (never multiplied by 0), and a NaN value is kept out of ``A v``'s
earlier rows (its column is NaN from its row on).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.channel_products import channel_products


@triton.jit
def gla_fwd_cumsum_kernel(
    g_ptr,
    NT,
    H,
    gc_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    MIN_LOG_DECAY: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), NT, B·H)``: ``G`` [B, T, H, K] float32, the cumulative sum of the
    gates within each chunk, each gate clamped below at ``MIN_LOG_DECAY`` (NaN stays NaN)."""
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + tl.arange(0, C)) * H
    p = rows[:, None] * K + o_k[None, :]
    b_g = tl.load(g_ptr + p, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_g = tl.where(b_g < MIN_LOG_DECAY, MIN_LOG_DECAY, b_g)
    tl.store(gc_ptr + p, tl.cumsum(b_g, axis=0), mask=m_k[None, :])


@triton.jit
def gla_fwd_h_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    init_ptr,
    flags_ptr,
    NT,
    H,
    R,
    h_ptr,
    final_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), cdiv(V, BV), B·H)``: chunk-start states ``h [B, H, NT, K, V]``
    and final states ``[B·R, H, K, V]`` (float32) of one (K block, V block, batch row, head)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    row0 = i_b.to(tl.int64) * NT * C * H + i_h  # token t of this row and head: row0 + t * H
    p_h = h_ptr + i_bh.to(tl.int64) * NT * K * V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(NT):
        flags = tl.load(flags_ptr + i_n)
        first, last = (flags & 1) != 0, (flags & 2) != 0
        state = ((i_b * R + (flags >> 2)).to(tl.int64) * H + i_h) * K * V
        b_init = tl.load(init_ptr + state + o_kv, mask=m_kv & first, other=0.0)
        b_h = tl.where(first, b_init, b_h)
        tl.store(p_h + i_n * K * V + o_kv, b_h.to(h_ptr.dtype.element_ty), mask=m_kv)
        rows = row0 + (i_n * C + o_c) * H
        p_kt = rows[None, :] * K + o_k[:, None]  # K and the gate as [BK, C]: Kᵀ's operand
        b_kt = tl.load(k_ptr + p_kt, mask=m_k[:, None], other=0.0)
        b_v = tl.load(v_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_gt = tl.load(g_ptr + p_kt, mask=m_k[:, None], other=0.0)
        b_glast = tl.load(g_ptr + (row0 + (i_n * C + C - 1) * H) * K + o_k, mask=m_k, other=0.0)
        b_kdt = (b_kt * tl.exp(b_glast[:, None] - b_gt)).to(b_v.dtype)
        b_h = b_h * tl.exp(b_glast)[:, None] + tl.dot(b_kdt, b_v, input_precision=DOT_PRECISION)
        tl.store(final_ptr + state + o_kv, b_h, mask=m_kv & last)


@triton.jit
def gla_fwd_a_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    scale,
    NT,
    H,
    a_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``: one chunk's ``A [C, C]`` (float32, ``[B, T, H, C]``; zero above the
    diagonal), :func:`~ejkernel_triton.kernels.channel_products.channel_products` on
    operands in ``q``'s dtype, times the scale."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    o_c = tl.arange(0, C)
    first = (i_bh // H).to(tl.int64) * NT * C * H + i_bh % H + i_n * C * H
    b_a, _ = channel_products(
        q_ptr, k_ptr, g_ptr, first, H, o_c, K, C, BK, DOT_PRECISION, True, False
    )
    rows = first + o_c * H
    tl.store(a_ptr + rows[:, None] * C + o_c[None, :], b_a * scale)


@triton.jit
def gla_fwd_o_kernel(
    q_ptr,
    v_ptr,
    g_ptr,
    h_ptr,
    a_ptr,
    scale,
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
    """Grid ``(cdiv(V, BV), NT, B·H)``: ``o = scale · (q ⊙ exp(G)) h + A v`` of one chunk."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < V
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + o_c) * H
    p_h = h_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V
    b_v = tl.load(v_ptr + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    dt = b_v.dtype
    # A v multiplies the zeros above A's diagonal too: NaN values enter it as zeros, and each
    # NaN value's column is NaN from its row on (as the recurrence's state column would be)
    nan_v = b_v != b_v
    b_v = tl.where(nan_v, 0.0, b_v).to(dt)
    poisoned = tl.cumsum(nan_v.to(tl.int32), axis=0) > 0
    b_o = tl.zeros([C, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_g = tl.load(g_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_h = tl.load(
            p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0
        )
        b_qg = (b_q * tl.exp(b_g) * scale).to(dt)
        b_o += tl.dot(b_qg, b_h.to(dt), input_precision=DOT_PRECISION)
    b_a = tl.load(a_ptr + rows[:, None] * C + o_c[None, :])
    b_o += tl.dot(b_a.to(dt), b_v, input_precision=DOT_PRECISION)
    b_o = tl.where(poisoned, float("nan"), b_o)
    tl.store(
        o_ptr + rows[:, None] * V + o_v[None, :], b_o.to(o_ptr.dtype.element_ty), mask=m_v[None, :]
    )
