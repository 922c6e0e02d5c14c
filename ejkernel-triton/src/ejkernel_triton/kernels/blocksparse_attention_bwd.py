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

from ejkernel_triton.kernels.blocksparse_attention_fwd import _listed, _tile_order
from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    MASK_VALUE,
    _aligned,
    _heads,
    _key_tile,
    _load_tile,
    _scores,
    _visible,
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
        index = Index + off_b * stride_ib + off_h * stride_ih + block_k * num_blocks
        counts = Count + off_b * stride_cb + off_h * stride_ch + block_k * 2
        for part in tl.static_range(2):  # whole blocks, then cut ones
            MASKED = part == 1 or BQ % BLOCK_M != 0
            HIDES = MASKED or HAS_MASK or HAS_SEG
            lo, hi = _listed(counts, part, SUB_Q)
            for t in range(lo, hi):
                block_q = tl.load(index + t // SUB_Q)
                q_end = tl.minimum(block_q * BQ + BQ, seqlen_q)
                rows = block_q * BQ + (t % SUB_Q) * BLOCK_M + tl.arange(0, BLOCK_M)
                geo = (q_pos_offset, q_end, k_end, window_left, window_right)
                q_ptrs = q_base + rows[:, None] * stride_qs + offs_d[None, :]
                q = _load_tile(q_ptrs, rows, q_end, offs_d, HEAD_DIM, BLOCK_D, MASKED)
                do_ptrs = do_base + rows[:, None] * stride_dos + offs_dv[None, :]
                do = _load_tile(do_ptrs, rows, q_end, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
                if MASKED:
                    lse = tl.load(lse_base + rows, mask=rows < q_end, other=EMPTY_LSE)
                    delta = tl.load(delta_base + rows, mask=rows < q_end, other=0.0)
                else:
                    lse = tl.load(lse_base + rows)
                    delta = tl.load(delta_base + rows)
                # transposed scores, [BLOCK_N, BLOCK_M], as in flash attention's dK/dV kernel
                qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
                s_t, t_t = _scores(qk_t, sm_scale, soft_cap, SOFT_CAP)
                s_t = _visible(s_t, rows[None, :], offs_n[:, None], geo, masks, MASKED, features)
                if MASKED:  # rows of the next query block (or none) share no step here
                    s_t = tl.where(rows[None, :] < q_end, s_t, MASK_VALUE)
                p_t = tl.exp2(s_t - lse[None, :])
                dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
                dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                if SOFT_CAP:
                    ds_t = ds_t * (1.0 - t_t * t_t)
                if HIDES:  # hidden: p = 0 exactly, and dS 0 even where v or k is not finite
                    ds_t = tl.where(p_t > 0.0, ds_t, 0.0)
                dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)

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
    SUB_Q: tl.constexpr = (BQ + BLOCK_M - 1) // BLOCK_M
    SUB_K: tl.constexpr = (BK + BLOCK_N - 1) // BLOCK_N
    tile = _tile_order(CAUSAL)
    block_q = tile // SUB_Q
    off_bh = tl.program_id(1)
    off_b, off_h, off_hk = _heads(off_bh, num_heads_q, num_heads_k)
    q_pos_offset = seqlen_k - seqlen_q
    q_end = tl.minimum(block_q * BQ + BQ, seqlen_q)
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_m = block_q * BQ + (tile % SUB_Q) * BLOCK_M + tl.arange(0, BLOCK_M)
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
    index = Index + off_b * stride_ib + off_h * stride_ih + block_q * num_blocks
    counts = Count + off_b * stride_cb + off_h * stride_ch + block_q * 2

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for part in tl.static_range(2):  # whole blocks, then cut ones
        MASKED = part == 1 or BK % BLOCK_N != 0
        HIDES = MASKED or HAS_MASK or HAS_SEG
        lo, hi = _listed(counts, part, SUB_K)
        for t in range(lo, hi):
            block_k = tl.load(index + t // SUB_K)
            k_end = tl.minimum(block_k * BK + BK, seqlen_k)
            cols = block_k * BK + (t % SUB_K) * BLOCK_N + tl.arange(0, BLOCK_N)
            geo = (q_pos_offset, q_end, k_end, window_left, window_right)
            k = _key_tile(k_base, cols, stride_ks, offs_d, k_end, HEAD_DIM, BLOCK_D, MASKED, HIDES)
            v = _key_tile(
                v_base, cols, stride_vs, offs_dv, k_end, HEAD_DIM_V, BLOCK_DV, MASKED, HIDES
            )
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            s, t_cap = _scores(qk, sm_scale, soft_cap, SOFT_CAP)
            s = _visible(s, offs_m[:, None], cols[None, :], geo, masks, MASKED, features)
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            if HAS_BIAS:
                tl.store(
                    dbias_ptr + offs_m[:, None] * seqlen_k + cols[None, :],
                    ds,
                    mask=(offs_m[:, None] < q_end) & (cols[None, :] < k_end),
                )
            if SOFT_CAP:
                ds = ds * (1.0 - t_cap * t_cap)
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)

    dq = dq * sm_scale
    dq_ptrs = (
        DQ + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    )
    tl.store(
        dq_ptrs,
        dq.to(DQ.dtype.element_ty),
        mask=(offs_m[:, None] < q_end) & (offs_d[None, :] < HEAD_DIM),
    )
