"""Triton flash attention forward: :func:`flash_attention_fwd_kernel` (every feature) and, for
the plain case on Hopper, :func:`flash_attention_fwd_ws_kernel` (TMA loads, Triton's automatic
warp specialization, persistent over the (query block, head) tiles).

Output ``[B, Sq, Hq, Dv]`` and the per-row log2-sum-exp ``[B, Hq, Sq]``; the shared arithmetic
is in :mod:`ejkernel_triton.kernels.flash_attention_common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton._kernel_cache import compile_directly
from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    LOG2E,
    MASK_VALUE,
    _aligned,
    _fwd_step,
    _head_rows,
    _heads,
    _key_ranges,
    _load_tile,
    _program_tile,
    _scores,
    _ws_mask,
    _ws_tile,
)

# -- forward --------------------------------------------------------------------------------


@triton.jit
def flash_attention_fwd_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    Aux,
    sm_scale,
    soft_cap,
    seqlen_q,
    seqlen_k,
    num_heads_q,
    num_heads_k,
    window_left,
    window_right,
    num_aux,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_biasb,
    stride_biash,
    stride_biasq,
    stride_biask,
    stride_maskb,
    stride_maskh,
    stride_maskq,
    stride_maskk,
    Out,
    Lse,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_AUX: tl.constexpr,
    BLOCK_AUX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    PLAIN_SCALE: tl.constexpr = False,
):
    """One program: ``BLOCK_M`` query rows of one (batch, query head). Grid ``(⌈Sq/BM⌉, B·Hq)``.

    The online softmax walks the key blocks in three parts (cut, whole, cut: see
    ``_key_ranges``). ``PLAIN_SCALE``: no soft cap, bias, mask or segments and a scale ≥ 0;
    then on whole blocks (nothing to mask or add) the raw scores' row maximum is scaled once
    per row and the scale rides in the exponent, ``exp2(qk · c − m)``: one FFMA a score where
    a multiply and a subtraction were, a tenth of the loop's instructions at D 64 (where the
    softmax's instructions bound it).
    """
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_ob, stride_os, stride_oh = _aligned(stride_ob, stride_os, stride_oh, ALIGN)
    start_m, off_bh = _program_tile(HEAD_GROUP)
    off_b, off_h, off_hk = _heads(off_bh, num_heads_q, num_heads_k)
    geo = (seqlen_k - seqlen_q, seqlen_q, seqlen_k, window_left, window_right)
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (
        Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    )
    q = _load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    masks = (
        (Bias + off_b * stride_biasb + off_h * stride_biash, stride_biasq, stride_biask),
        (Mask + off_b * stride_maskb + off_h * stride_maskh, stride_maskq, stride_maskk),
        (QSeg + off_b * seqlen_q, KSeg + off_b * seqlen_k),
    )

    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    ranges = _key_ranges(start_m * BLOCK_M, geo, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    for part in tl.static_range(3):  # cut blocks, whole blocks, cut blocks
        MASKED = part != 1  # constexprs: a cut block; a step whose select hides keys
        HIDES = MASKED or HAS_MASK or HAS_SEG
        for start_n in range(ranges[part], ranges[part + 1], BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _fwd_step(
                q,
                offs_m,
                cols,
                (offs_d, offs_dv),
                (k_base, v_base, stride_ks, stride_vs),
                (m_i, l_i, acc),
                seqlen_k,
                (sm_scale, soft_cap),
                geo,
                masks,
                features,
                (HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV),
                (MASKED, HIDES, PLAIN_SCALE and part == 1, SOFT_CAP),
                DOT_PRECISION,
            )

    empty = m_i <= MASK_VALUE * 0.5
    if HAS_AUX:
        offs_a = tl.arange(0, BLOCK_AUX)
        aux = tl.load(Aux + off_h * num_aux + offs_a, mask=offs_a < num_aux, other=0.0)
        aux = tl.where(offs_a < num_aux, aux.to(tl.float32) * LOG2E, MASK_VALUE)
        m_f = tl.maximum(m_i, tl.max(aux, 0))
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.sum(tl.exp2(aux[None, :] - m_f[:, None]), 1)
        acc = acc * alpha[:, None]
        m_i = m_f
        empty = empty & (m_i <= MASK_VALUE * 0.5)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, EMPTY_LSE, m_i + tl.log2(l_safe))

    o_ptrs = (
        Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :]
    )
    if BLOCK_DV == HEAD_DIM_V:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seqlen_q)
    else:
        tl.store(
            o_ptrs,
            out.to(Out.dtype.element_ty),
            mask=(offs_m[:, None] < seqlen_q) & (offs_dv[None, :] < HEAD_DIM_V),
        )
    tl.store(Lse + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


# -- forward, warp-specialized (Hopper) -----------------------------------------------------


@compile_directly
@triton.jit
def flash_attention_fwd_ws_kernel(
    Q,
    K,
    V,
    Index,
    Count,
    sm_scale,
    soft_cap,
    batch,
    seqlen_q,
    seqlen_k,
    num_heads,
    num_kv_heads,
    num_blocks,
    stride_ib,
    stride_ih,
    stride_cb,
    stride_ch,
    Out,
    Lse,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    LISTED: tl.constexpr = False,
):
    """The forward for the plain case (no bias, mask, segments, window or sinks; D = Dv, a
    power of two), written for Triton's Hopper warp specialization. Persistent: the grid's
    programs (one per SM) walk the (query block, batch·head) tiles, and the tile loop carries
    ``warp_specialize=True``, so the compiler splits the program into a producer warp group
    (the TMA loads of Q, K and V) and two consumer warp groups of ``BLOCK_M / 2`` rows each;
    one tile's epilogue overlaps the next tile's loads.

    The key loop inside masks every block when ``CAUSAL`` or a cut last block (``EVEN_K``
    false) needs it: the pass rejects a second loop, and a branch in the loop turns the
    specialization off. The pass also fails on any operation between a tile's TMA load and its
    matmul, so the caller passes K and V through ``finite_or_zero`` when blocks are masked. Rows and blocks are addressed in 2-D views ``[B·S, H·D]``; a key block
    that runs into the next batch's rows is masked like one past the end, and query rows past
    ``seqlen_q`` are never stored.

    ``LISTED`` (block-sparse attention, the mask's blocks its ``BLOCK_M × BLOCK_N`` tiles): the
    key loop walks the tile's list of live key blocks instead of every block it may see:
    ``Index [B|1, Hq|1, nq, num_blocks]`` the blocks, ``Count [B|1, Hq|1, nq, 2]`` their
    counts (the live one second), with batch and head strides (0 where the mask broadcasts;
    :func:`ejkernel_triton.ops.blocksparse_attention.block_lists`). Otherwise they are unused.
    """
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    heads = batch * num_heads
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    ctx = (sm_scale, soft_cap, q_pos_offset, seqlen_k)
    FLAGS: tl.constexpr = (BLOCK_N, CAUSAL, SOFT_CAP, EVEN_K)
    for tile in tl.range(tl.program_id(0), num_m * heads, tl.num_programs(0), warp_specialize=True):
        start_m, off_bh, off_b, off_h, off_hk = _ws_tile(
            tile, num_m, heads, num_heads, num_kv_heads, CAUSAL
        )
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        q = q_desc.load([off_b * seqlen_q + start_m * BLOCK_M, off_h * HEAD_DIM])
        m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_at = (k_desc, v_desc, off_b * seqlen_k, off_hk * HEAD_DIM)
        if LISTED:
            index = Index + off_b * stride_ib + off_h * stride_ih + start_m * num_blocks
            live = tl.load(Count + off_b * stride_cb + off_h * stride_ch + start_m * 2 + 1)
            for t in tl.range(0, live):
                start_n = tl.load(index + t) * BLOCK_N
                m_i, l_i, acc = ws_key_step(q, kv_at, start_n, offs_m, (m_i, l_i, acc), ctx, FLAGS)
        else:
            end = seqlen_k
            if CAUSAL:
                end = tl.maximum(
                    tl.minimum(start_m * BLOCK_M + BLOCK_M + q_pos_offset, seqlen_k), 0
                )
            for start_n in tl.range(0, end, BLOCK_N):
                m_i, l_i, acc = ws_key_step(q, kv_at, start_n, offs_m, (m_i, l_i, acc), ctx, FLAGS)
        ws_store(
            Out, Lse, (m_i, l_i, acc), offs_m, off_b, off_h, off_bh, seqlen_q, num_heads, HEAD_DIM
        )


@triton.jit
def ws_key_step(q, kv_at, start_n, offs_m, state, ctx, FLAGS: tl.constexpr):
    """One key block of a warp-specialized forward: the block at key ``start_n`` of
    ``kv_at = (k_desc, v_desc, first key row of this batch, this key head's column)`` (TMA
    loads), masked as :func:`_ws_mask` says; ``state = (m_i, l_i, acc)`` in and out;
    ``ctx = (sm_scale, soft_cap, q_pos_offset, seqlen_k)``; ``FLAGS = (BLOCK_N, CAUSAL,
    SOFT_CAP, EVEN_K)``."""
    BLOCK_N, CAUSAL, SOFT_CAP, EVEN_K = FLAGS
    k_desc, v_desc, k_row, col = kv_at
    m_i, l_i, acc = state
    sm_scale, soft_cap, q_pos_offset, seqlen_k = ctx
    k = k_desc.load([k_row + start_n, col])
    s, _ = _scores(tl.dot(q, tl.trans(k)), sm_scale, soft_cap, SOFT_CAP)
    s = _ws_mask(s, start_n, offs_m, q_pos_offset, seqlen_k, BLOCK_N, CAUSAL, EVEN_K)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([k_row + start_n, col])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def ws_store(
    Out, Lse, state, offs_m, off_b, off_h, off_bh, seqlen_q, num_heads, HEAD_DIM: tl.constexpr
):
    """A warp-specialized forward's epilogue: the rows ``offs_m`` of query head ``off_h`` as
    output (zeros for a row that saw no key) and logsumexp, rows past ``seqlen_q`` not stored."""
    m_i, l_i, acc = state
    empty = m_i <= MASK_VALUE * 0.5
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, EMPTY_LSE, m_i + tl.log2(l_safe))
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (off_b * seqlen_q + offs_m[:, None]) * (num_heads * HEAD_DIM) + off_h * HEAD_DIM
    tl.store(
        Out + rows + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=offs_m[:, None] < seqlen_q,
    )
    tl.store(Lse + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
