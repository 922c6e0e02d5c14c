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
  ``A[i, j] = scale · Σ_k q_ik k_jk exp(G_ik − G_jk)`` (j ≤ i) in sub-chunks of ``BC`` rows:
  against the earlier sub-chunks the decay splits at the first row ``r`` of the query
  sub-chunk, ``(q ⊙ exp(G − G_r)) (k ⊙ exp(G_r − G))ᵀ`` (one product over the chunk's rows
  before ``r``), both exponents ≤ 0 for decaying gates; inside a sub-chunk it is formed entry
  by entry from ``exp(G_i − G_j)``, masked before the exp. No
  exp ever sees the (positive) difference of a later and an earlier cumulative decay, so gates
  down to any log decay give no Inf or NaN (flash-linear-attention's ``chunk_gla`` scheme).
- :func:`gla_fwd_o_kernel`: ``o = scale · (q ⊙ exp(G)) h_chunk + A v``.

A NaN in an input stays in its causal future, as in the recurrence: the masked entries of
``A`` are selected away (never multiplied by 0), and a NaN value is kept out of ``A v``'s
earlier rows (its column is NaN from its row on).
"""

from __future__ import annotations

import triton
import triton.language as tl


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


#: Largest log-decay span inside a sub-chunk whose diagonal block is one product through the
#: sub-chunk's first row: its factor ``exp(G_r − G_s)`` stays below ``e^60`` (finite in bf16
#: and float32) or, for float16 operands, ``e^8`` (float16 ends near ``e^11``); a wider span
#: takes the block entry by entry.
DIAGONAL_PRODUCT_SPAN: tl.constexpr = tl.constexpr(60.0)
DIAGONAL_PRODUCT_SPAN_F16: tl.constexpr = tl.constexpr(8.0)


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
    BC: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT · C / BC, B·H)``: rows ``[i·BC, (i+1)·BC)`` of one chunk's ``A [C, C]``
    (float32, ``[B, T, H, C]``; zero above the diagonal).

    Every decay factors through the query sub-chunk's first row ``r``: the columns of the
    earlier sub-chunks come from one product ``(q ⊙ exp(G − G_r)) (k ⊙ exp(G_r − G))ᵀ`` against
    the chunk's key rows before ``r`` (later rows selected away before it), both exponents
    ≤ 0 for decaying gates. The diagonal block takes the same product over its own keys where
    the block of key channels decays by at most :data:`DIAGONAL_PRODUCT_SPAN` across the
    sub-chunk (``exp(G_r − G_s)`` then stays finite; the entries above the diagonal are
    selected away), and otherwise goes entry by entry, ``exp(G_i − G_j)`` masked to
    ``j ≤ i`` before the exp."""
    NC: tl.constexpr = C // BC
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_n, i_i = i_c // NC, i_c % NC
    i_b, i_h = i_bh // H, i_bh % H
    o_r = tl.arange(0, BC)
    o_c = tl.arange(0, C)
    row0 = i_b.to(tl.int64) * NT * C * H + i_h
    t_i = i_n * C + i_i * BC  # first token of the query sub-chunk
    rows_i = row0 + (t_i + o_r) * H
    rows_c = row0 + (i_n * C + o_c) * H  # every key row of the chunk
    earlier = o_c < i_i * BC
    dt = q_ptr.dtype.element_ty
    b_a = tl.zeros([BC, C], dtype=tl.float32)
    b_d = tl.zeros([BC, BC], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        p_i = rows_i[:, None] * K + o_k[None, :]
        b_q = tl.load(q_ptr + p_i, mask=m_k[None, :], other=0.0)
        b_gq = tl.load(g_ptr + p_i, mask=m_k[None, :], other=0.0)
        b_gr = tl.load(g_ptr + (row0 + t_i * H) * K + o_k, mask=m_k, other=0.0)
        m_j = earlier[:, None] & m_k[None, :]
        b_k = tl.load(k_ptr + rows_c[:, None] * K + o_k[None, :], mask=m_j, other=0.0)
        b_gk = tl.load(g_ptr + rows_c[:, None] * K + o_k[None, :], mask=m_j, other=0.0)
        b_qg = (b_q * tl.exp(b_gq - b_gr[None, :])).to(dt)
        # selected, never multiplied by 0: a NaN key of a later row stays out of these rows
        b_kg = tl.where(earlier[:, None], b_k * tl.exp(b_gr[None, :] - b_gk), 0.0).to(dt)
        b_a += tl.dot(b_qg, tl.trans(b_kg), input_precision=DOT_PRECISION)
        # the diagonal block: one product where these channels' span allows it (a NaN span
        # fails the test and goes entry by entry)
        b_kd = tl.load(k_ptr + p_i, mask=m_k[None, :], other=0.0)
        span = tl.max(b_gr[None, :] - b_gq)
        limit: tl.constexpr = (
            DIAGONAL_PRODUCT_SPAN_F16 if dt == tl.float16 else DIAGONAL_PRODUCT_SPAN
        )
        if span <= limit:
            b_kdg = (b_kd * tl.exp(b_gr[None, :] - b_gq)).to(dt)
            b_d += tl.dot(b_qg, tl.trans(b_kdg), input_precision=DOT_PRECISION)
        else:
            b_qf = b_q.to(tl.float32)
            for j in range(0, BC):
                row_j = row0 + (t_i + j) * H
                b_kj = tl.load(k_ptr + row_j * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_gj = tl.load(g_ptr + row_j * K + o_k, mask=m_k, other=0.0)
                causal = o_r[:, None] >= j
                b_e = tl.where(causal, b_gq - b_gj[None, :], float("-inf"))
                # the product is masked too: a NaN key stays out of earlier rows
                b_col = tl.sum(tl.where(causal, b_qf * b_kj[None, :] * tl.exp(b_e), 0.0), axis=1)
                b_d = tl.where(o_r[None, :] == j, b_d + b_col[:, None], b_d)
    b_d = tl.where(o_r[:, None] >= o_r[None, :], b_d, 0.0)  # selected: NaN keys above stay out
    # two stores to disjoint columns: the diagonal block, and the rest of the row block (the
    # earlier sub-chunks' products, zeros after the diagonal)
    in_diag = (o_c >= i_i * BC) & (o_c < i_i * BC + BC)
    p_a = a_ptr + rows_i[:, None] * C
    b_rest = tl.where(earlier[None, :], b_a * scale, 0.0)
    tl.store(p_a + o_c[None, :], b_rest, mask=~in_diag[None, :])
    tl.store(p_a + i_i * BC + o_r[None, :], b_d * scale)


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
