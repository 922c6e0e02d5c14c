"""Triton block-sparse attention backward: :func:`blocksparse_attention_bwd_dq_kernel` (one
program per ``BLOCK_M`` rows of a query block and query head, over the block's live key blocks;
it also computes ``delta = rowsum(out ∘ dO)`` and the bias gradient), then
:func:`blocksparse_attention_bwd_dkdv_kernel` (one program per ``BLOCK_N`` keys of a key block
and key head, over the live query blocks of each query head of its group: the transposed
lists; no K/V repeat, no atomics).

The lists, the flat (listed block, tile) loops and the per-tile geometry are the forward's
(:mod:`ejkernel_triton.kernels.blocksparse_attention_fwd`); the arithmetic is flash
attention's backward (:mod:`ejkernel_triton.kernels.flash_attention_bwd`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.blocksparse_attention_fwd import (
    _listed,
    _listed_tile,
    _query_tile,
    _row_lists,
)
from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    _aligned,
    _dkdv_step,
    _dq_step,
    _key_tile,
    _load_tile,
)


@triton.jit
def blocksparse_attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    Index,
    Count,
    DO,
    Lse,
    Delta,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_biasb,
    stride_biash,
    stride_biasq,
    stride_biask,
    stride_maskb,
    stride_maskh,
    stride_maskq,
    stride_maskk,
    DK,
    DV,
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
):
    """One program: ``BLOCK_N`` keys of one key block, one (batch, key head), over its group's
    query heads. Grid ``(⌈Sk/BK⌉ · ⌈BK/BLOCK_N⌉, B·Hkv)``.

    ``Index [B|1, Hq|1, nk, nq]`` and ``Count [B|1, Hq|1, nk, 2]``: each key block's live query
    blocks (``num_blocks = nq`` a row), whole ones first, per query head. On a cut step, rows
    past the query block's end are hidden too, so they add nothing to dK/dV.
    """
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_dob, stride_dos, stride_doh = _aligned(stride_dob, stride_dos, stride_doh, ALIGN)
    SUB_Q: tl.constexpr = (BQ + BLOCK_M - 1) // BLOCK_M
    SUB_K: tl.constexpr = (BK + BLOCK_N - 1) // BLOCK_N
    block_k = tl.program_id(0) // SUB_K
    off_bhk = tl.program_id(1)
    off_b = off_bhk // num_heads_k
    off_hk = off_bhk % num_heads_k
    group = num_heads_q // num_heads_k
    q_pos_offset = seqlen_k - seqlen_q
    k_end = tl.minimum(block_k * BK + BK, seqlen_k)
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_n = block_k * BK + (tl.program_id(0) % SUB_K) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # the program's K/V tile, loaded once and never cleaned, as in flash attention's dK/dV
    # kernel: a non-finite entry of key j reaches only row j of dK/dV, and a step that hides
    # keys zeroes the dS of hidden pairs
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    k = _key_tile(k_base, offs_n, stride_ks, offs_d, k_end, HEAD_DIM, BLOCK_D, True, False)
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    v = _key_tile(v_base, offs_n, stride_vs, offs_dv, k_end, HEAD_DIM_V, BLOCK_DV, True, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    seg = (QSeg + off_b * seqlen_q, KSeg + off_b * seqlen_k)
    lists = (Index, Count, stride_ib, stride_ih, stride_cb, stride_ch)
    for g in range(0, group):
        off_h = off_hk * group + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        lse_base = Lse + (off_b * num_heads_q + off_h) * seqlen_q
        delta_base = Delta + (off_b * num_heads_q + off_h) * seqlen_q
        masks = (
            (Bias + off_b * stride_biasb + off_h * stride_biash, stride_biasq, stride_biask),
            (Mask + off_b * stride_maskb + off_h * stride_maskh, stride_maskq, stride_maskk),
            seg,
        )
        index, counts = _row_lists(lists, off_b, off_h, block_k, num_blocks)
        for part in tl.static_range(2):  # whole blocks, then cut ones
            MASKED = part == 1 or BQ % BLOCK_M != 0
            HIDES = MASKED or HAS_MASK or HAS_SEG
            lo, hi = _listed(counts, part, SUB_Q)
            for t in range(lo, hi):
                rows, q_end = _listed_tile(index, t, seqlen_q, SUB_Q, BQ, BLOCK_M)
                geo = (q_pos_offset, q_end, k_end, window_left, window_right)
                dk, dv = _dkdv_step(
                    k,
                    v,
                    offs_n,
                    rows,
                    (offs_d, offs_dv),
                    (q_base, do_base, lse_base, delta_base, stride_qs, stride_dos),
                    (dk, dv),
                    q_end,
                    (sm_scale, soft_cap),
                    geo,
                    masks,
                    features,
                    (HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV),
                    (MASKED, HIDES, True, SOFT_CAP),
                    DOT_PRECISION,
                )

    dk = dk * sm_scale
    dk_ptrs = (
        DK + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    )
    dv_ptrs = (
        DV + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :]
    )
    tl.store(
        dk_ptrs,
        dk.to(DK.dtype.element_ty),
        mask=(offs_n[:, None] < k_end) & (offs_d[None, :] < HEAD_DIM),
    )
    tl.store(
        dv_ptrs,
        dv.to(DV.dtype.element_ty),
        mask=(offs_n[:, None] < k_end) & (offs_dv[None, :] < HEAD_DIM_V),
    )


@triton.jit
def blocksparse_attention_bwd_dq_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    Index,
    Count,
    DO,
    Lse,
    Out,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_biasb,
    stride_biash,
    stride_biasq,
    stride_biask,
    stride_maskb,
    stride_maskh,
    stride_maskq,
    stride_maskk,
    DQ,
    DBias,
    Delta,
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
):
    """One program: ``BLOCK_M`` rows of one query block, one (batch, query head). Grid
    ``(⌈Sq/BQ⌉ · ⌈BQ/BLOCK_M⌉, B·Hq)``; the lists are the forward's.

    Stores its rows' ``delta = rowsum(Out ∘ dO)`` (``[B, Hq, Sq]`` float32) for the dK/dV
    kernel, and with a bias the logit gradient of every visited entry to ``DBias``
    (``[B, Hq, Sq, Sk]`` float32, zeroed before the launch).
    """
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_dob, stride_dos, stride_doh = _aligned(stride_dob, stride_dos, stride_doh, ALIGN)
    SUB_K: tl.constexpr = (BK + BLOCK_N - 1) // BLOCK_N
    block_q, off_bh, off_b, off_h, off_hk, q_end, offs_m = _query_tile(
        seqlen_q, num_heads_q, num_heads_k, BQ, BLOCK_M, CAUSAL
    )
    q_pos_offset = seqlen_k - seqlen_q
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(
        Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        offs_m,
        q_end,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    row_offs = off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dos
    do = _load_tile(
        DO + row_offs + offs_dv[None, :], offs_m, q_end, offs_dv, HEAD_DIM_V, BLOCK_DV, True
    )
    o = _load_tile(
        Out + row_offs + offs_dv[None, :], offs_m, q_end, offs_dv, HEAD_DIM_V, BLOCK_DV, True
    )
    lse = tl.load(Lse + off_bh * seqlen_q + offs_m, mask=offs_m < q_end, other=EMPTY_LSE)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_bh * seqlen_q + offs_m, delta, mask=offs_m < q_end)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    masks = (
        (Bias + off_b * stride_biasb + off_h * stride_biash, stride_biasq, stride_biask),
        (Mask + off_b * stride_maskb + off_h * stride_maskh, stride_maskq, stride_maskk),
        (QSeg + off_b * seqlen_q, KSeg + off_b * seqlen_k),
    )
    dbias_ptr = DBias + off_bh.to(tl.int64) * seqlen_q * seqlen_k
    lists = (Index, Count, stride_ib, stride_ih, stride_cb, stride_ch)
    index, counts = _row_lists(lists, off_b, off_h, block_q, num_blocks)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for part in tl.static_range(2):  # whole blocks, then cut ones
        MASKED = part == 1 or BK % BLOCK_N != 0
        HIDES = MASKED or HAS_MASK or HAS_SEG
        lo, hi = _listed(counts, part, SUB_K)
        for t in range(lo, hi):
            cols, k_end = _listed_tile(index, t, seqlen_k, SUB_K, BK, BLOCK_N)
            geo = (q_pos_offset, q_end, k_end, window_left, window_right)
            dq = _dq_step(
                q,
                do,
                (lse, delta),
                offs_m,
                cols,
                (offs_d, offs_dv),
                (k_base, v_base, stride_ks, stride_vs),
                dq,
                (dbias_ptr, seqlen_k),
                (q_end, k_end),
                (sm_scale, soft_cap),
                geo,
                masks,
                features,
                (HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV),
                (MASKED, HIDES, HAS_BIAS, SOFT_CAP),
                DOT_PRECISION,
            )

    dq = dq * sm_scale
    dq_ptrs = (
        DQ + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    )
    tl.store(
        dq_ptrs,
        dq.to(DQ.dtype.element_ty),
        mask=(offs_m[:, None] < q_end) & (offs_d[None, :] < HEAD_DIM),
    )
