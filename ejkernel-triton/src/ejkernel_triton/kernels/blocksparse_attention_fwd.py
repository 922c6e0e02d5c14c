"""Triton block-sparse attention forward: :func:`blocksparse_attention_fwd_kernel` (every
feature; for the plain case on Hopper, flash attention's warp-specialized forward walks the
same lists: ``LISTED`` in
:func:`ejkernel_triton.kernels.flash_attention_fwd.flash_attention_fwd_ws_kernel`).

A program owns ``BLOCK_M`` query rows inside one query block of the mask (``BQ`` rows) and
walks only that block's live key blocks, read from a list built outside the kernel
(:func:`ejkernel_triton.ops.blocksparse_attention.block_lists`): per (batch, head, query
block) the indices of the live key blocks, those every row sees whole by position first
(``n_full`` of them), then the ones the causal diagonal, the window or a sequence end cuts
(``n_live`` in all). A key block of ``BK`` keys is walked in ``BLOCK_N``-key tiles; the walk is
one flat loop over (listed block, tile) pairs, so the software pipeline spans blocks. Dead
blocks are never read.

The score, mask and softmax arithmetic is flash attention's
(:mod:`ejkernel_triton.kernels.flash_attention_common`): each tile is checked against a
geometry whose sequence ends are its query block's and key block's ends, so rows and keys of a
neighbouring block never enter. Output ``[B, Sq, Hq, Dv]`` and the per-row log2-sum-exp
``[B, Hq, Sq]`` (``EMPTY_LSE`` for a row that saw no key: zeros, and every recomputed
probability 0 in the backward).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    MASK_VALUE,
    _aligned,
    _fwd_step,
    _heads,
    _load_tile,
)


@triton.jit
def _listed(counts, part: tl.constexpr, SUB: tl.constexpr):
    """``[lo, hi)`` of the flat (listed block, tile) loop of ``part`` (0: the blocks every row
    sees whole, 1: the cut ones); ``counts`` points at the row's ``(n_full, n_live)``."""
    n_full = tl.load(counts)
    if part == 0:
        lo = n_full * 0
        hi = n_full * SUB
    else:
        lo = n_full * SUB
        hi = tl.load(counts + 1) * SUB
    return lo, hi


@triton.jit
def _listed_tile(index, t, seqlen, SUB: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    """Step ``t`` of a flat (listed block, tile) loop over blocks of ``B`` positions walked in
    ``BLOCK``-wide tiles (``SUB`` a block): the tile's positions and where its block ends."""
    block = tl.load(index + t // SUB)
    end = tl.minimum(block * B + B, seqlen)
    offs = block * B + (t % SUB) * BLOCK + tl.arange(0, BLOCK)
    return offs, end


@triton.jit
def _query_tile(
    seqlen_q,
    num_heads_q,
    num_heads_k,
    BQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """A program of a grid ``(⌈Sq/BQ⌉ · ⌈BQ/BLOCK_M⌉, B·Hq)``: its query block, (batch·head,
    batch, query head, key head), its rows and where its query block ends."""
    SUB_Q: tl.constexpr = (BQ + BLOCK_M - 1) // BLOCK_M
    tile = _tile_order(CAUSAL)
    block_q = tile // SUB_Q
    off_bh = tl.program_id(1)
    off_b, off_h, off_hk = _heads(off_bh, num_heads_q, num_heads_k)
    q_end = tl.minimum(block_q * BQ + BQ, seqlen_q)
    offs_m = block_q * BQ + (tile % SUB_Q) * BLOCK_M + tl.arange(0, BLOCK_M)
    return block_q, off_bh, off_b, off_h, off_hk, q_end, offs_m


@triton.jit
def _row_lists(lists, off_b, off_h, block, num_blocks):
    """The list row of ``block`` at (batch, head): pointers to its live blocks and to its
    ``(n_full, n_live)``; ``lists = (Index, Count, stride_ib, stride_ih, stride_cb,
    stride_ch)``."""
    Index, Count, stride_ib, stride_ih, stride_cb, stride_ch = lists
    index = Index + off_b * stride_ib + off_h * stride_ih + block * num_blocks
    counts = Count + off_b * stride_cb + off_h * stride_ch + block * 2
    return index, counts


@triton.jit
def _tile_order(CAUSAL: tl.constexpr):
    """The query tile of a program of a grid ``(tiles, B·H)``: under a causal mask the last
    tiles, whose rows see the most keys, start first (the GPU starts programs in order), so
    the short ones fill the end."""
    tile = tl.program_id(0)
    if CAUSAL:
        tile = tl.num_programs(0) - 1 - tile
    return tile


@triton.jit
def blocksparse_attention_fwd_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    Index,
    Count,
    sm_scale,
    soft_cap,
    seqlen_q,
    seqlen_k,
    num_heads_q,
    num_heads_k,
    window_left,
    window_right,
    num_blocks,
    stride_ib,
    stride_ih,
    stride_cb,
    stride_ch,
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
    BQ: tl.constexpr,
    BK: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    PLAIN_SCALE: tl.constexpr = False,
):
    """One program: ``BLOCK_M`` rows of one query block, one (batch, query head).

    Grid ``(⌈Sq/BQ⌉ · ⌈BQ/BLOCK_M⌉, B·Hq)``. ``Index [B|1, Hq|1, nq, nk]`` int32 holds each
    query block's live key blocks (``num_blocks = nk`` a row), ``Count [B|1, Hq|1, nq, 2]``
    its ``(n_full, n_live)``; their batch and head strides are 0 where the mask broadcasts.
    ``PLAIN_SCALE`` as in flash attention's forward: on the blocks every row sees whole, with
    nothing to mask or add and a scale ≥ 0, the scale rides in the exponent.
    """
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_ob, stride_os, stride_oh = _aligned(stride_ob, stride_os, stride_oh, ALIGN)
    SUB_K: tl.constexpr = (BK + BLOCK_N - 1) // BLOCK_N
    block_q, off_bh, off_b, off_h, off_hk, q_end, offs_m = _query_tile(
        seqlen_q, num_heads_q, num_heads_k, BQ, BLOCK_M, CAUSAL
    )
    q_pos_offset = seqlen_k - seqlen_q
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (
        Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    )
    q = _load_tile(q_ptrs, offs_m, q_end, offs_d, HEAD_DIM, BLOCK_D, True)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    masks = (
        (Bias + off_b * stride_biasb + off_h * stride_biash, stride_biasq, stride_biask),
        (Mask + off_b * stride_maskb + off_h * stride_maskh, stride_maskq, stride_maskk),
        (QSeg + off_b * seqlen_q, KSeg + off_b * seqlen_k),
    )
    lists = (Index, Count, stride_ib, stride_ih, stride_cb, stride_ch)
    index, counts = _row_lists(lists, off_b, off_h, block_q, num_blocks)

    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for part in tl.static_range(2):  # the blocks every row sees whole, then the cut ones
        # constexprs: a step with positional masks (a cut block, or tiles that overrun a
        # block), and a step whose select hides keys
        MASKED = part == 1 or BK % BLOCK_N != 0
        HIDES = MASKED or HAS_MASK or HAS_SEG
        lo, hi = _listed(counts, part, SUB_K)
        for t in range(lo, hi):
            cols, k_end = _listed_tile(index, t, seqlen_k, SUB_K, BK, BLOCK_N)
            geo = (q_pos_offset, q_end, k_end, window_left, window_right)
            m_i, l_i, acc = _fwd_step(
                q,
                offs_m,
                cols,
                (offs_d, offs_dv),
                (k_base, v_base, stride_ks, stride_vs),
                (m_i, l_i, acc),
                k_end,
                (sm_scale, soft_cap),
                geo,
                masks,
                features,
                (HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV),
                (MASKED, HIDES, PLAIN_SCALE and not MASKED, SOFT_CAP),
                DOT_PRECISION,
            )

    empty = m_i <= MASK_VALUE * 0.5
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, EMPTY_LSE, m_i + tl.log2(l_safe))

    o_ptrs = (
        Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :]
    )
    if BLOCK_DV == HEAD_DIM_V:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < q_end)
    else:
        tl.store(
            o_ptrs,
            out.to(Out.dtype.element_ty),
            mask=(offs_m[:, None] < q_end) & (offs_dv[None, :] < HEAD_DIM_V),
        )
    tl.store(Lse + off_bh * seqlen_q + offs_m, lse, mask=offs_m < q_end)
