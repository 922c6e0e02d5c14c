"""Triton flash attention backward: :func:`flash_attention_bwd_dq_kernel` (one program per query
block and query head; it also computes ``delta = rowsum(out ∘ dO)`` and the bias gradient),
then :func:`flash_attention_bwd_dkdv_kernel` (one program per key block and key head, looping
over the group's query heads: no K/V repeat, no atomics); for the plain case on Hopper the
warp-specialized TMA twins :func:`flash_attention_bwd_dkdv_ws_kernel` and
:func:`flash_attention_bwd_dq_ws_kernel`, which take delta from JAX.

The shared arithmetic is in :mod:`ejkernel_triton.kernels.flash_attention_common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton._kernel_cache import compile_directly
from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    MASK_VALUE,
    _aligned,
    _dkdv_step,
    _dq_step,
    _head_rows,
    _heads,
    _key_ranges,
    _key_tile,
    _load_tile,
    _program_tile,
    _query_ranges,
    _row_stats,
    _scores,
    _ws_mask,
)

# -- backward: dK and dV ---------------------------------------------------------------------


@triton.jit
def flash_attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
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
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One program: ``BLOCK_N`` keys of one (batch, key head), over its group's query heads.

    Grid ``(⌈Sk/BN⌉, B·Hkv)``; dK/dV are written in the key dtype, ``[B, Sk, Hkv, D]`` layout.
    """
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_dob, stride_dos, stride_doh = _aligned(stride_dob, stride_dos, stride_doh, ALIGN)
    start_n = tl.program_id(0)
    off_bhk = tl.program_id(1)
    off_b = off_bhk // num_heads_k
    off_hk = off_bhk % num_heads_k
    group = num_heads_q // num_heads_k
    geo = (seqlen_k - seqlen_q, seqlen_q, seqlen_k, window_left, window_right)
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # the program's K/V tile, loaded once for all its steps and never cleaned (a cleaned copy
    # would take shared memory of its own): a non-finite entry of key j reaches only row j of
    # dK/dV, as every product here keeps keys apart, and a step that hides keys zeroes the dS
    # of hidden pairs, so a key no row sees gets zero gradients
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    k = _key_tile(k_base, offs_n, stride_ks, offs_d, seqlen_k, HEAD_DIM, BLOCK_D, True, False)
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    v = _key_tile(v_base, offs_n, stride_vs, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_DV, True, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    ranges = _query_ranges(start_n * BLOCK_N, geo, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
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
        for part in tl.static_range(3):  # cut blocks, whole blocks, cut blocks
            MASKED = part != 1  # constexprs: a cut block; a step whose select hides keys
            HIDES = MASKED or HAS_MASK or HAS_SEG
            for start_m in range(ranges[part], ranges[part + 1], BLOCK_M):
                rows = start_m + tl.arange(0, BLOCK_M)
                dk, dv = _dkdv_step(
                    k,
                    v,
                    offs_n,
                    rows,
                    (offs_d, offs_dv),
                    (q_base, do_base, lse_base, delta_base, stride_qs, stride_dos),
                    (dk, dv),
                    seqlen_q,
                    (sm_scale, soft_cap),
                    geo,
                    masks,
                    features,
                    (HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV),
                    (MASKED, HIDES, False, SOFT_CAP),
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
        mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM),
    )
    tl.store(
        dv_ptrs,
        dv.to(DV.dtype.element_ty),
        mask=(offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V),
    )


# -- backward: dQ (and the bias gradient) ---------------------------------------------------


@triton.jit
def flash_attention_bwd_dq_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
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
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One program: ``BLOCK_M`` query rows of one (batch, query head). Grid ``(⌈Sq/BM⌉, B·Hq)``.

    The program also computes its rows' ``delta = rowsum(Out ∘ dO)`` (``Out``: the forward's
    output, laid out as ``dO``) and stores it to ``Delta`` (``[B, Hq, Sq]`` float32) for the
    dK/dV kernel, which runs after it: no separate pass over ``Out`` and ``dO``.

    With a bias, the logit gradient ``dS`` of every visited entry goes to ``DBias``
    (``[B, Hq, Sq, Sk]`` float32, zeroed before the launch); the wrapper sums it into the bias's
    broadcast shape.
    """
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_dob, stride_dos, stride_doh = _aligned(stride_dob, stride_dos, stride_doh, ALIGN)
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b, off_h, off_hk = _heads(off_bh, num_heads_q, num_heads_k)
    geo = (seqlen_k - seqlen_q, seqlen_q, seqlen_k, window_left, window_right)
    features = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(
        Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        offs_m,
        seqlen_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    # dO and the forward's output share a layout: one set of offsets
    row_offs = off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dos
    do = _load_tile(
        DO + row_offs + offs_dv[None, :], offs_m, seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True
    )
    o = _load_tile(
        Out + row_offs + offs_dv[None, :], offs_m, seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True
    )
    lse = tl.load(Lse + off_bh * seqlen_q + offs_m, mask=offs_m < seqlen_q, other=EMPTY_LSE)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # 0 past seqlen_q
    tl.store(Delta + off_bh * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    masks = (
        (Bias + off_b * stride_biasb + off_h * stride_biash, stride_biasq, stride_biask),
        (Mask + off_b * stride_maskb + off_h * stride_maskh, stride_maskq, stride_maskk),
        (QSeg + off_b * seqlen_q, KSeg + off_b * seqlen_k),
    )
    dbias_ptr = DBias + off_bh.to(tl.int64) * seqlen_q * seqlen_k

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    ranges = _key_ranges(start_m * BLOCK_M, geo, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    for part in tl.static_range(3):  # cut blocks, whole blocks, cut blocks
        MASKED = part != 1  # constexprs: a cut block; a step whose select hides keys
        HIDES = MASKED or HAS_MASK or HAS_SEG
        for start_n in range(ranges[part], ranges[part + 1], BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
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
                (seqlen_q, seqlen_k),
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
        mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM),
    )


# -- backward dK/dV, warp-specialized (Hopper) -----------------------------------------------


@triton.jit
def _dkdv_ws_step(dk, dv, kv, rows_at, off_h, start_m, ctx, FLAGS: tl.constexpr):
    """One query step of the warp-specialized dK/dV kernel: ``dk``, ``dv`` in and out; ``kv =
    (k, v, offs_n)`` the program's keys; the ``BLOCK_M`` query rows from ``start_m`` of query
    head ``off_h``, from ``rows_at = (q_desc, do_desc, Lse, Delta, off_b, seqlen_q,
    num_heads)``; ``ctx = (sm_scale, soft_cap, q_pos_offset)``; ``FLAGS = (BLOCK_M, HEAD_DIM,
    CAUSAL, SOFT_CAP)``."""
    BLOCK_M, HEAD_DIM, CAUSAL, SOFT_CAP = FLAGS
    k, v, offs_n = kv
    q_desc, do_desc, Lse, Delta, off_b, seqlen_q, num_heads = rows_at
    sm_scale, soft_cap, q_pos_offset = ctx
    rows = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([off_b * seqlen_q + start_m, off_h * HEAD_DIM])
    stats = (off_b * num_heads + off_h) * seqlen_q + rows
    lse = tl.load(Lse + stats, mask=rows < seqlen_q, other=EMPTY_LSE)
    # transposed scores, [BLOCK_N, BLOCK_M], as in the usual dK/dV kernel
    s_t, t_t = _scores(tl.dot(k, tl.trans(q)), sm_scale, soft_cap, SOFT_CAP)
    if CAUSAL:
        s_t = tl.where(offs_n[:, None] <= rows[None, :] + q_pos_offset, s_t, MASK_VALUE)
    p_t = tl.exp2(s_t - lse[None, :])
    do = do_desc.load([off_b * seqlen_q + start_m, off_h * HEAD_DIM])
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    delta = tl.load(Delta + stats, mask=rows < seqlen_q, other=0.0)
    ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
    if SOFT_CAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@compile_directly
@triton.jit
def flash_attention_bwd_dkdv_ws_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
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
    DK,
    DV,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    LISTED: tl.constexpr = False,
    BQ: tl.constexpr = 0,
):
    """The dK/dV kernel for the plain case, written for Triton's Hopper warp specialization
    (as :func:`flash_attention_fwd_ws_kernel`): Q and dO arrive by TMA and the compiler splits
    the program's ``BLOCK_N`` keys between two consumer warp groups.

    One specialized loop walks (query head of the group, query block) pairs. Query rows past
    ``seqlen_q`` (read from the next batch, or zeros) get ``lse = EMPTY_LSE`` and so ``p = 0``;
    key rows past ``seqlen_k`` are computed and not stored.

    ``LISTED`` (block-sparse attention; the program's keys one key block of the mask): the loop
    walks the key block's list of live (query head of the group, query block of ``BQ`` rows)
    pairs, each in ``BLOCK_M``-row steps. ``Index [B|1, Hkv, nk, num_blocks]`` holds them as
    ``head · nq + block`` (``num_blocks = group · nq``), ``Count [B|1, Hkv, nk, 2]`` their
    number second; batch and key-head strides (0 where the mask broadcasts).
    """
    start_n = tl.program_id(0)
    off_bhk = tl.program_id(1)
    off_b = off_bhk // num_kv_heads
    off_hk = off_bhk % num_kv_heads
    group = num_heads // num_kv_heads
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    do_desc = _head_rows(DO, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    k = k_desc.load([off_b * seqlen_k + start_n * BLOCK_N, off_hk * HEAD_DIM])
    v = v_desc.load([off_b * seqlen_k + start_n * BLOCK_N, off_hk * HEAD_DIM])
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    rows_at = (q_desc, do_desc, Lse, Delta, off_b, seqlen_q, num_heads)
    kv = (k, v, offs_n)
    ctx = (sm_scale, soft_cap, q_pos_offset)
    FLAGS: tl.constexpr = (BLOCK_M, HEAD_DIM, CAUSAL, SOFT_CAP)
    if LISTED:
        SUB: tl.constexpr = BQ // BLOCK_M
        nq = num_blocks // group
        index = Index + off_b * stride_ib + off_hk * stride_ih + start_n * num_blocks
        live = tl.load(Count + off_b * stride_cb + off_hk * stride_ch + start_n * 2 + 1)
        for it in tl.range(0, live * SUB, warp_specialize=True):
            pair = tl.load(index + it // SUB)
            off_h = off_hk * group + pair // nq
            start_m = (pair % nq) * BQ + (it % SUB) * BLOCK_M
            dk, dv = _dkdv_ws_step(dk, dv, kv, rows_at, off_h, start_m, ctx, FLAGS)
    else:
        lo = 0
        if CAUSAL:  # the first query block that sees this program's first key
            lo = tl.maximum(start_n * BLOCK_N - q_pos_offset, 0) // BLOCK_M * BLOCK_M
        blocks = tl.cdiv(seqlen_q - lo, BLOCK_M)
        for it in tl.range(0, group * blocks, warp_specialize=True):
            off_h = off_hk * group + it // blocks
            start_m = lo + (it % blocks) * BLOCK_M
            dk, dv = _dkdv_ws_step(dk, dv, kv, rows_at, off_h, start_m, ctx, FLAGS)

    offs_d = tl.arange(0, HEAD_DIM)
    rows_k = (off_b * seqlen_k + offs_n[:, None]) * (num_kv_heads * HEAD_DIM)
    ptrs = rows_k + off_hk * HEAD_DIM + offs_d[None, :]
    tl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < seqlen_k)
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < seqlen_k)


# -- backward dQ, warp-specialized (Hopper) --------------------------------------------------


@triton.jit
def _dq_ws_step(dq, rows, kv_at, start_n, ctx, FLAGS: tl.constexpr):
    """One key block of the warp-specialized dQ kernel: ``dq`` in and out; ``rows = (q, do,
    lse, delta, offs_m)`` of the program's query rows; the block at key ``start_n`` of
    ``kv_at = (k_desc, v_desc, first key row of this batch, this key head's column)``;
    ``ctx = (sm_scale, soft_cap, q_pos_offset, seqlen_k)``; ``FLAGS = (BLOCK_N, CAUSAL,
    SOFT_CAP, EVEN_K)``."""
    BLOCK_N, CAUSAL, SOFT_CAP, EVEN_K = FLAGS
    q, do, lse, delta, offs_m = rows
    k_desc, v_desc, k_row, col = kv_at
    sm_scale, soft_cap, q_pos_offset, seqlen_k = ctx
    k = k_desc.load([k_row + start_n, col])
    s, t = _scores(tl.dot(q, tl.trans(k)), sm_scale, soft_cap, SOFT_CAP)
    s = _ws_mask(s, start_n, offs_m, q_pos_offset, seqlen_k, BLOCK_N, CAUSAL, EVEN_K)
    p = tl.exp2(s - lse[:, None])
    v = v_desc.load([k_row + start_n, col])
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    if SOFT_CAP:
        ds = ds * (1.0 - t * t)
    return tl.dot(ds.to(k.dtype), k, dq)


@compile_directly
@triton.jit
def flash_attention_bwd_dq_ws_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    Index,
    Count,
    sm_scale,
    soft_cap,
    batch,
    seqlen_q,
    seqlen_k,
    num_heads,
    num_kv_heads,
    stats_len,
    num_blocks,
    stride_ib,
    stride_ih,
    stride_cb,
    stride_ch,
    DQ,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    LISTED: tl.constexpr = False,
):
    """The dQ kernel for the plain case, written for Triton's Hopper warp specialization (as
    :func:`flash_attention_fwd_ws_kernel`, whose loop it follows): K and V arrive by TMA and
    the compiler splits the program's ``BLOCK_M`` query rows between two consumer warp groups.

    ``Lse``/``Delta`` come as ``[B, H, stats_len]`` (``stats_len`` a multiple of ``BLOCK_M``,
    so every TMA offset is 16-byte aligned). Query rows past ``seqlen_q`` are computed from
    the padding (or the next batch's rows) and not stored; key rows past ``seqlen_k`` (the
    next batch's, or zeros) are masked like the forward's. ``HEAD_GROUP``: the program order
    of :func:`_program_tile`. ``LISTED``: the key loop walks the query block's list of live key
    blocks (block-sparse attention; as the forward's ``LISTED``).
    """
    start_m, off_bh = _program_tile(HEAD_GROUP)
    off_b, off_h, off_hk = _heads(off_bh, num_heads, num_kv_heads)
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    do_desc = _head_rows(DO, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = q_desc.load([off_b * seqlen_q + start_m * BLOCK_M, off_h * HEAD_DIM])
    do = do_desc.load([off_b * seqlen_q + start_m * BLOCK_M, off_h * HEAD_DIM])
    # the row statistics by TMA too (the pass fails on pointer loads it must split by rows),
    # from rows of stats_len >= seqlen_q entries, a multiple of BLOCK_M (padded by the caller)
    stats = off_bh * stats_len + start_m * BLOCK_M
    lse = _row_stats(Lse, batch * num_heads * stats_len, BLOCK_M).load([stats])
    delta = _row_stats(Delta, batch * num_heads * stats_len, BLOCK_M).load([stats])
    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_at = (k_desc, v_desc, off_b * seqlen_k, off_hk * HEAD_DIM)
    rows = (q, do, lse, delta, offs_m)
    ctx = (sm_scale, soft_cap, q_pos_offset, seqlen_k)
    FLAGS: tl.constexpr = (BLOCK_N, CAUSAL, SOFT_CAP, EVEN_K)
    if LISTED:
        index = Index + off_b * stride_ib + off_h * stride_ih + start_m * num_blocks
        live = tl.load(Count + off_b * stride_cb + off_h * stride_ch + start_m * 2 + 1)
        for t in tl.range(0, live, warp_specialize=True):
            dq = _dq_ws_step(dq, rows, kv_at, tl.load(index + t) * BLOCK_N, ctx, FLAGS)
    else:
        end = seqlen_k
        if CAUSAL:
            end = tl.maximum(tl.minimum(start_m * BLOCK_M + BLOCK_M + q_pos_offset, seqlen_k), 0)
        for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            dq = _dq_ws_step(dq, rows, kv_at, start_n, ctx, FLAGS)

    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = (off_b * seqlen_q + offs_m[:, None]) * (num_heads * HEAD_DIM) + off_h * HEAD_DIM
    tl.store(
        DQ + ptrs + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=offs_m[:, None] < seqlen_q,
    )
