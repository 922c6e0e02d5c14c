"""Triton kernels of flash attention: the forward, and the backward as two kernels (dQ, which
also computes ``delta = rowsum(out ∘ dO)``, then dK/dV).

The algorithm is FlashAttention-2 (Dao, 2023). Layout is OPS.md's: ``q [B, Sq, Hq, D]``,
``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``; ``lse``/``delta`` are ``[B, Hq, Sq]`` float32.

- Scores live in the log2 domain: ``s = (softcap(scale · q·kᵀ) + bias) · log2(e)``, so the
  softmax uses ``exp2``. Masked entries get the finite :data:`MASK_VALUE`; a row whose running
  maximum is still ``MASK_VALUE`` at the end saw no key, stores zeros and ``lse = EMPTY_LSE``,
  which makes every recomputed probability of it exactly 0 in the backward.
- Each program walks its key blocks (forward, dQ) or query blocks (dK/dV) in three ranges:
  blocks cut by the causal diagonal, the window edges or the sequence end (``MASKED``), the
  blocks every row sees completely (no positional mask, no bounds checks), and the cut blocks
  on the other side. Blocks nobody sees are never visited.
- GQA: the dK/dV program of one key head loops over the query heads of its group, so K/V are
  never repeated in memory and dK/dV need no atomics.
- Sinks (``softmax_aux``) join the maximum and the denominator once, after the key loop.
- Head dims that are not powers of two (80, 96) load ``BLOCK_D = next_pow2(D)`` columns with a
  mask; powers of two skip the mask.

On Hopper the plain case has three more kernels, :func:`flash_attention_fwd_ws_kernel`,
:func:`flash_attention_bwd_dkdv_ws_kernel` and :func:`flash_attention_bwd_dq_ws_kernel`: TMA
loads and Triton's automatic warp specialization. On the GPU the Gluon kernels of
:mod:`ejkernel_triton.kernels.flash_attention_hopper` (which the interpreter cannot run) take
over the forward at D 128 (FlashAttention-3's schedule) and dK/dV.

The kernels are plain ``@triton.jit`` functions. The launch wrapper
(:mod:`ejkernel_triton.ops.flash_attention`) calls them through jax-triton on a GPU, or through
Triton's interpreter on a CPU (:mod:`ejkernel_triton._launch` re-imports this module with the
interpreter switched on, so the same source runs both ways).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton._kernel_cache import compile_directly

#: log2(e): scores are kept in the log2 domain.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
#: Score of a masked entry (finite: ``MASK_VALUE - MASK_VALUE`` is 0, never NaN).
MASK_VALUE: tl.constexpr = tl.constexpr(-1.0e30)
#: Stored log2-sum-exp of a row that saw no key: ``exp2(s - EMPTY_LSE)`` is 0 for any ``s``.
EMPTY_LSE: tl.constexpr = tl.constexpr(3.0e38)


# -- shared pieces --------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp2 (works in the interpreter and compiles to ex2 on the GPU), of |x| so
    # that exp2 never overflows (inf / inf for x below about -44)
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _aligned(stride_b, stride_s, stride_h, ALIGN: tl.constexpr):
    """A tensor's batch, sequence and head strides, passed in units of ``ALIGN`` elements, in
    elements.

    jax-triton passes integer arguments without divisibility hints (and ``tl.multiple_of`` /
    ``tl.assume`` on an argument reach no analysis), so strides counted in elements would
    leave every tile load a 2-byte load with no pipelined copy. Multiplying by the constexpr
    ``ALIGN`` gives the compiler the divisibility: 16-byte loads, ``cp.async`` stages.
    """
    return stride_b * ALIGN, stride_s * ALIGN, stride_h * ALIGN


@triton.jit
def _load_tile(
    ptrs,
    rows,
    n_rows,
    cols,
    N_COLS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Load ``[len(rows), BLOCK_COLS]`` with zeros outside ``rows < n_rows`` / ``cols < N_COLS``."""
    if CHECK_ROWS:
        if BLOCK_COLS == N_COLS:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
    else:
        if BLOCK_COLS == N_COLS:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    return x


@triton.jit
def _scores(qk, sm_scale, soft_cap, SOFT_CAP: tl.constexpr):
    """``(softcap(scale · qk) · log2e, tanh)``; ``tanh`` is what the soft-cap gradient needs."""
    if SOFT_CAP:
        t = _tanh(qk * (sm_scale / soft_cap))
        s = t * (soft_cap * LOG2E)
    else:
        t = qk  # unused
        s = qk * (sm_scale * LOG2E)
    return s, t


@triton.jit
def _visible(
    s,
    qi,
    kj,
    q_pos_offset,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    bias_ptr,
    mask_ptr,
    qseg_ptr,
    kseg_ptr,
    stride_biasq,
    stride_biask,
    stride_maskq,
    stride_maskk,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
):
    """Add the bias and apply every mask to a tile of log2-domain scores.

    ``qi``/``kj`` are the query and key indices broadcast to the tile: ``rows[:, None]`` and
    ``cols[None, :]`` for a ``[queries, keys]`` tile, or the other way round for the
    transposed tile of the dK/dV kernel. ``bias_ptr``/``mask_ptr`` point at this (batch,
    head)'s ``[Sq, Sk]`` plane (strides may be 0 for broadcast dims); ``qseg_ptr``/``kseg_ptr``
    at this batch's segment ids.
    """
    in_bounds = (qi < seqlen_q) & (kj < seqlen_k)
    if HAS_BIAS:
        b = tl.load(
            bias_ptr + qi * stride_biasq + kj * stride_biask,
            mask=in_bounds,
            other=0.0,
        )
        s = s + b.to(tl.float32) * LOG2E
    keep = (qi >= 0) & (kj >= 0)  # all true, of the tile's shape
    if MASKED:
        keep = keep & (kj < seqlen_k)
        pos = qi + q_pos_offset
        if CAUSAL:
            keep = keep & (kj <= pos)
        if WINDOW:
            keep = keep & (kj >= pos - window_left) & (kj <= pos + window_right)
    if HAS_MASK:
        m = tl.load(
            mask_ptr + qi * stride_maskq + kj * stride_maskk,
            mask=in_bounds,
            other=0,
        )
        keep = keep & (m != 0)
    if HAS_SEG:
        qs = tl.load(qseg_ptr + qi, mask=qi < seqlen_q, other=-1)
        ks = tl.load(kseg_ptr + kj, mask=kj < seqlen_k, other=-2)
        keep = keep & (qs == ks) & (qs >= 0)
    if MASKED or HAS_MASK or HAS_SEG:
        s = tl.where(keep, s, MASK_VALUE)
    return s


@triton.jit
def _key_ranges(
    m_lo,
    m_hi,
    q_pos_offset,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Key blocks for query rows ``[m_lo, m_hi)``: ``(start, full_start, full_end, end)``.

    ``[start, end)`` holds every key some row sees; ``[full_start, full_end)`` (multiples of
    ``BLOCK_N``) the blocks every row sees whole, within bounds.
    """
    p_first = m_lo + q_pos_offset
    p_last = m_hi - 1 + q_pos_offset
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if CAUSAL:
        hi = tl.minimum(hi, p_last + 1)
        full_hi = tl.minimum(full_hi, p_first + 1)
    if WINDOW:
        lo = tl.maximum(lo, p_first - window_left)
        hi = tl.minimum(hi, p_last + window_right + 1)
        full_lo = tl.maximum(full_lo, p_last - window_left)
        full_hi = tl.minimum(full_hi, p_first + window_right + 1)
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    start = (lo // BLOCK_N) * BLOCK_N
    end = tl.maximum(hi, start)
    full_start = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, start), end)
    full_end = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def _query_ranges(
    n_lo,
    n_hi,
    q_pos_offset,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Query blocks for key columns ``[n_lo, n_hi)``, as :func:`_key_ranges` for queries."""
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if CAUSAL:
        lo = tl.maximum(lo, n_lo - q_pos_offset)
        full_lo = tl.maximum(full_lo, n_hi - 1 - q_pos_offset)
    if WINDOW:
        lo = tl.maximum(lo, n_lo - window_right - q_pos_offset)
        hi = tl.minimum(hi, n_hi - 1 + window_left - q_pos_offset + 1)
        full_lo = tl.maximum(full_lo, n_hi - 1 - window_right - q_pos_offset)
        full_hi = tl.minimum(full_hi, n_lo + window_left - q_pos_offset + 1)
    if n_lo + BLOCK_N > seqlen_k:  # a key block cut by the sequence end is masked everywhere
        full_hi = 0
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    start = (lo // BLOCK_M) * BLOCK_M
    end = tl.maximum(hi, start)
    full_start = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, start), end)
    full_end = tl.minimum(tl.maximum((full_hi // BLOCK_M) * BLOCK_M, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def _program_tile(HEAD_GROUP: tl.constexpr):
    """``(query block, batch·head)`` of a forward program in a grid ``(blocks, B·H)``.

    ``HEAD_GROUP`` 0: grid order. Otherwise (causal, where programs differ in length) the GPU,
    which starts programs in order of their linear id, gets the heads in groups of
    ``HEAD_GROUP`` and, within a group, the longest (last) query blocks of all its heads first:
    the last programs to start are short, and the programs running at one time read the K/V of
    a few heads only, which stay in L2. The backward's kernels take the same order (dK/dV
    reversed: its longest programs are its first key blocks).
    """
    if HEAD_GROUP == 0:
        block = tl.program_id(0)
        off_bh = tl.program_id(1)
    else:
        blocks = tl.num_programs(0)
        heads = tl.num_programs(1)
        order = tl.program_id(1) * blocks + tl.program_id(0)
        group = order // (HEAD_GROUP * blocks)
        within = order % (HEAD_GROUP * blocks)
        size = tl.minimum(heads - group * HEAD_GROUP, HEAD_GROUP)
        block = blocks - 1 - within // size
        off_bh = group * HEAD_GROUP + within % size
    return block, off_bh


# -- forward --------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    lo,
    hi,
    offs_m,
    offs_d,
    offs_dv,
    stride_ks,
    stride_vs,
    sm_scale,
    soft_cap,
    q_pos_offset,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    bias_ptr,
    mask_ptr,
    qseg_ptr,
    kseg_ptr,
    stride_biasq,
    stride_biask,
    stride_maskq,
    stride_maskk,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALE_IN_EXP: tl.constexpr,
):
    """The online softmax over key blocks ``[lo, hi)``. With ``SCALE_IN_EXP`` (whole blocks,
    nothing to add or mask, no soft cap, a scale ≥ 0) the raw scores' row maximum is scaled
    once per row and the scale rides in the exponent, ``exp2(qk · c − m)``: one FFMA a score
    where a multiply and a subtraction were, a tenth of the loop's instructions at D 64 (where
    the softmax's instructions bound it)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(
            k_base + cols[:, None] * stride_ks + offs_d[None, :],
            cols,
            seqlen_k,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SCALE_IN_EXP:  # nothing to mask or add: the scale rides in the exponent's FFMA
            m_new = tl.maximum(m_i, tl.max(qk, 1) * (sm_scale * LOG2E))
            p = tl.exp2(qk * (sm_scale * LOG2E) - m_new[:, None])
        else:
            s, _ = _scores(qk, sm_scale, soft_cap, SOFT_CAP)
            s = _visible(
                s,
                offs_m[:, None],
                cols[None, :],
                q_pos_offset,
                seqlen_q,
                seqlen_k,
                window_left,
                window_right,
                bias_ptr,
                mask_ptr,
                qseg_ptr,
                kseg_ptr,
                stride_biasq,
                stride_biask,
                stride_maskq,
                stride_maskk,
                MASKED,
                CAUSAL,
                WINDOW,
                HAS_BIAS,
                HAS_MASK,
                HAS_SEG,
            )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_tile(
            v_base + cols[:, None] * stride_vs + offs_dv[None, :],
            cols,
            seqlen_k,
            offs_dv,
            HEAD_DIM_V,
            BLOCK_DV,
            MASKED,
        )
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


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
    ``PLAIN_SCALE``: no soft cap, bias, mask or segments and a scale ≥ 0 (see ``_fwd_inner``)."""
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_ob, stride_os, stride_oh = _aligned(stride_ob, stride_os, stride_oh, ALIGN)
    start_m, off_bh = _program_tile(HEAD_GROUP)
    off_b = off_bh // num_heads_q
    off_h = off_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)
    q_pos_offset = seqlen_k - seqlen_q

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (
        Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    )
    q = _load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    bias_ptr = Bias + off_b * stride_biasb + off_h * stride_biash
    mask_ptr = Mask + off_b * stride_maskb + off_h * stride_maskh
    qseg_ptr = QSeg + off_b * seqlen_q
    kseg_ptr = KSeg + off_b * seqlen_k

    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_hi = tl.minimum(start_m * BLOCK_M + BLOCK_M, seqlen_q)
    start, full_start, full_end, end = _key_ranges(
        start_m * BLOCK_M,
        m_hi,
        q_pos_offset,
        seqlen_k,
        window_left,
        window_right,
        BLOCK_N,
        CAUSAL,
        WINDOW,
    )
    for part in tl.static_range(3):  # cut blocks, whole blocks, cut blocks
        if part == 0:
            lo, hi = start, full_start
        elif part == 1:
            lo, hi = full_start, full_end
        else:
            lo, hi = full_end, end
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            lo,
            hi,
            offs_m,
            offs_d,
            offs_dv,
            stride_ks,
            stride_vs,
            sm_scale,
            soft_cap,
            q_pos_offset,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
            bias_ptr,
            mask_ptr,
            qseg_ptr,
            kseg_ptr,
            stride_biasq,
            stride_biask,
            stride_maskq,
            stride_maskk,
            HEAD_DIM,
            HEAD_DIM_V,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_N,
            part != 1,
            CAUSAL,
            WINDOW,
            SOFT_CAP,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
            DOT_PRECISION,
            PLAIN_SCALE and part == 1,
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


# -- backward: dK and dV ---------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    lo,
    hi,
    offs_n,
    offs_d,
    offs_dv,
    stride_qs,
    stride_dos,
    sm_scale,
    soft_cap,
    q_pos_offset,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    bias_ptr,
    mask_ptr,
    qseg_ptr,
    kseg_ptr,
    stride_biasq,
    stride_biask,
    stride_maskq,
    stride_maskk,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(
            q_base + rows[:, None] * stride_qs + offs_d[None, :],
            rows,
            seqlen_q,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        do = _load_tile(
            do_base + rows[:, None] * stride_dos + offs_dv[None, :],
            rows,
            seqlen_q,
            offs_dv,
            HEAD_DIM_V,
            BLOCK_DV,
            MASKED,
        )
        if MASKED:
            lse = tl.load(lse_base + rows, mask=rows < seqlen_q, other=EMPTY_LSE)
            delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        # transposed scores, [BLOCK_N, BLOCK_M]: p and ds then feed dV and dK as they are,
        # with no transpose of a register tile (which costs a trip through shared memory)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        s_t, t_t = _scores(qk_t, sm_scale, soft_cap, SOFT_CAP)
        s_t = _visible(
            s_t,
            rows[None, :],
            offs_n[:, None],
            q_pos_offset,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
            bias_ptr,
            mask_ptr,
            qseg_ptr,
            kseg_ptr,
            stride_biasq,
            stride_biask,
            stride_maskq,
            stride_maskk,
            MASKED,
            CAUSAL,
            WINDOW,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
        )
        p_t = tl.exp2(s_t - lse[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFT_CAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


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
    q_pos_offset = seqlen_k - seqlen_q

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(
        K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
        offs_n,
        seqlen_k,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    v = _load_tile(
        V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
        offs_n,
        seqlen_k,
        offs_dv,
        HEAD_DIM_V,
        BLOCK_DV,
        True,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    n_hi = tl.minimum(start_n * BLOCK_N + BLOCK_N, seqlen_k)
    start, full_start, full_end, end = _query_ranges(
        start_n * BLOCK_N,
        n_hi,
        q_pos_offset,
        seqlen_q,
        seqlen_k,
        window_left,
        window_right,
        BLOCK_M,
        BLOCK_N,
        CAUSAL,
        WINDOW,
    )
    qseg_ptr = QSeg + off_b * seqlen_q
    kseg_ptr = KSeg + off_b * seqlen_k
    for g in range(0, group):
        off_h = off_hk * group + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        lse_base = Lse + (off_b * num_heads_q + off_h) * seqlen_q
        delta_base = Delta + (off_b * num_heads_q + off_h) * seqlen_q
        bias_ptr = Bias + off_b * stride_biasb + off_h * stride_biash
        mask_ptr = Mask + off_b * stride_maskb + off_h * stride_maskh
        for part in tl.static_range(3):  # cut blocks, whole blocks, cut blocks
            if part == 0:
                lo, hi = start, full_start
            elif part == 1:
                lo, hi = full_start, full_end
            else:
                lo, hi = full_end, end
            dk, dv = _bwd_dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                lse_base,
                delta_base,
                lo,
                hi,
                offs_n,
                offs_d,
                offs_dv,
                stride_qs,
                stride_dos,
                sm_scale,
                soft_cap,
                q_pos_offset,
                seqlen_q,
                seqlen_k,
                window_left,
                window_right,
                bias_ptr,
                mask_ptr,
                qseg_ptr,
                kseg_ptr,
                stride_biasq,
                stride_biask,
                stride_maskq,
                stride_maskk,
                HEAD_DIM,
                HEAD_DIM_V,
                BLOCK_D,
                BLOCK_DV,
                BLOCK_M,
                part != 1,
                CAUSAL,
                WINDOW,
                SOFT_CAP,
                HAS_BIAS,
                HAS_MASK,
                HAS_SEG,
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
def _bwd_dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    dbias_ptr,
    lo,
    hi,
    offs_m,
    offs_d,
    offs_dv,
    stride_ks,
    stride_vs,
    sm_scale,
    soft_cap,
    q_pos_offset,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    bias_ptr,
    mask_ptr,
    qseg_ptr,
    kseg_ptr,
    stride_biasq,
    stride_biask,
    stride_maskq,
    stride_maskk,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(
            k_base + cols[:, None] * stride_ks + offs_d[None, :],
            cols,
            seqlen_k,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        v = _load_tile(
            v_base + cols[:, None] * stride_vs + offs_dv[None, :],
            cols,
            seqlen_k,
            offs_dv,
            HEAD_DIM_V,
            BLOCK_DV,
            MASKED,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, t = _scores(qk, sm_scale, soft_cap, SOFT_CAP)
        s = _visible(
            s,
            offs_m[:, None],
            cols[None, :],
            q_pos_offset,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
            bias_ptr,
            mask_ptr,
            qseg_ptr,
            kseg_ptr,
            stride_biasq,
            stride_biask,
            stride_maskq,
            stride_maskk,
            MASKED,
            CAUSAL,
            WINDOW,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
        )
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_BIAS:
            tl.store(
                dbias_ptr + offs_m[:, None] * seqlen_k + cols[None, :],
                ds,
                mask=(offs_m[:, None] < seqlen_q) & (cols[None, :] < seqlen_k),
            )
        if SOFT_CAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


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
    off_b = off_bh // num_heads_q
    off_h = off_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)
    q_pos_offset = seqlen_k - seqlen_q

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
    bias_ptr = Bias + off_b * stride_biasb + off_h * stride_biash
    mask_ptr = Mask + off_b * stride_maskb + off_h * stride_maskh
    qseg_ptr = QSeg + off_b * seqlen_q
    kseg_ptr = KSeg + off_b * seqlen_k
    dbias_ptr = DBias + off_bh.to(tl.int64) * seqlen_q * seqlen_k

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_hi = tl.minimum(start_m * BLOCK_M + BLOCK_M, seqlen_q)
    start, full_start, full_end, end = _key_ranges(
        start_m * BLOCK_M,
        m_hi,
        q_pos_offset,
        seqlen_k,
        window_left,
        window_right,
        BLOCK_N,
        CAUSAL,
        WINDOW,
    )
    for part in tl.static_range(3):  # cut blocks, whole blocks, cut blocks
        if part == 0:
            lo, hi = start, full_start
        elif part == 1:
            lo, hi = full_start, full_end
        else:
            lo, hi = full_end, end
        dq = _bwd_dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            dbias_ptr,
            lo,
            hi,
            offs_m,
            offs_d,
            offs_dv,
            stride_ks,
            stride_vs,
            sm_scale,
            soft_cap,
            q_pos_offset,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
            bias_ptr,
            mask_ptr,
            qseg_ptr,
            kseg_ptr,
            stride_biasq,
            stride_biask,
            stride_maskq,
            stride_maskk,
            HEAD_DIM,
            HEAD_DIM_V,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_N,
            part != 1,
            CAUSAL,
            WINDOW,
            SOFT_CAP,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
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


# -- warp-specialized kernels (Hopper) -------------------------------------------------------


@triton.jit
def _head_rows(ptr, rows, heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor of ``[B, S, H, D]`` seen as ``[rows = B·S, H·D]``, ``BLOCK`` rows of one
    head per load (at column ``head · HEAD_DIM``)."""
    return tl.make_tensor_descriptor(
        ptr,
        shape=[rows, heads * HEAD_DIM],
        strides=[heads * HEAD_DIM, 1],
        block_shape=[BLOCK, HEAD_DIM],
    )


@triton.jit
def _row_stats(ptr, size, BLOCK: tl.constexpr):
    """A TMA descriptor of a flat float32 ``[B·H·S]`` array, ``BLOCK`` entries per load."""
    return tl.make_tensor_descriptor(ptr, shape=[size], strides=[1], block_shape=[BLOCK])


@triton.jit
def _ws_mask(
    s,
    start_n,
    offs_m,
    q_pos_offset,
    seqlen_k,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Scores of a key block starting at ``start_n`` for rows ``offs_m``, masked where
    ``CAUSAL`` or a cut last block (``EVEN_K`` false) needs it (for a stored row, a causally
    visible key is also inside ``seqlen_k``)."""
    if CAUSAL:
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(cols[None, :] <= offs_m[:, None] + q_pos_offset, s, MASK_VALUE)
    elif not EVEN_K:
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(cols[None, :] < seqlen_k, s, MASK_VALUE)
    return s


@triton.jit
def _ws_tile(tile, num_m, heads, num_heads, num_kv_heads, CAUSAL: tl.constexpr):
    """A persistent program's tile: (query block, batch, query head, key head). Query blocks
    go in descending order when ``CAUSAL`` (the longest rows first), heads fastest."""
    start_m = tile // heads
    if CAUSAL:
        start_m = num_m - 1 - start_m
    off_bh = tile % heads
    off_h = off_bh % num_heads
    return start_m, off_bh, off_bh // num_heads, off_h, off_h // (num_heads // num_kv_heads)


@compile_directly
@triton.jit
def flash_attention_fwd_ws_kernel(
    Q,
    K,
    V,
    sm_scale,
    soft_cap,
    batch,
    seqlen_q,
    seqlen_k,
    num_heads,
    num_kv_heads,
    Out,
    Lse,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The forward for the plain case (no bias, mask, segments, window or sinks; D = Dv, a
    power of two), written for Triton's Hopper warp specialization. Persistent: the grid's
    programs (one per SM) walk the (query block, batch·head) tiles, and the tile loop carries
    ``warp_specialize=True``, so the compiler splits the program into a producer warp group
    (the TMA loads of Q, K and V) and two consumer warp groups of ``BLOCK_M / 2`` rows each;
    one tile's epilogue overlaps the next tile's loads.

    The key loop inside masks every block when ``CAUSAL`` or a cut last block (``EVEN_K``
    false) needs it: the pass rejects a second loop, and a branch in the loop turns the
    specialization off. Rows and blocks are addressed in 2-D views ``[B·S, H·D]``; a key block
    that runs into the next batch's rows is masked like one past the end, and query rows past
    ``seqlen_q`` are never stored.
    """
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    heads = batch * num_heads
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    offs_d = tl.arange(0, HEAD_DIM)
    for tile in tl.range(tl.program_id(0), num_m * heads, tl.num_programs(0), warp_specialize=True):
        start_m, off_bh, off_b, off_h, off_hk = _ws_tile(
            tile, num_m, heads, num_heads, num_kv_heads, CAUSAL
        )
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        q = q_desc.load([off_b * seqlen_q + start_m * BLOCK_M, off_h * HEAD_DIM])
        m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = seqlen_k
        if CAUSAL:
            end = tl.maximum(tl.minimum(start_m * BLOCK_M + BLOCK_M + q_pos_offset, seqlen_k), 0)
        k_row = off_b * seqlen_k
        for start_n in tl.range(0, end, BLOCK_N):
            k = k_desc.load([k_row + start_n, off_hk * HEAD_DIM])
            s, _ = _scores(tl.dot(q, tl.trans(k)), sm_scale, soft_cap, SOFT_CAP)
            s = _ws_mask(s, start_n, offs_m, q_pos_offset, seqlen_k, BLOCK_N, CAUSAL, EVEN_K)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = v_desc.load([k_row + start_n, off_hk * HEAD_DIM])
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new

        empty = m_i <= MASK_VALUE * 0.5
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
        lse = tl.where(empty, EMPTY_LSE, m_i + tl.log2(l_safe))
        rows = (off_b * seqlen_q + offs_m[:, None]) * (num_heads * HEAD_DIM) + off_h * HEAD_DIM
        tl.store(
            Out + rows + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=offs_m[:, None] < seqlen_q,
        )
        tl.store(Lse + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


# -- backward dK/dV, warp-specialized (Hopper) -----------------------------------------------


@compile_directly
@triton.jit
def flash_attention_bwd_dkdv_ws_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    sm_scale,
    soft_cap,
    batch,
    seqlen_q,
    seqlen_k,
    num_heads,
    num_kv_heads,
    DK,
    DV,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """The dK/dV kernel for the plain case, written for Triton's Hopper warp specialization
    (as :func:`flash_attention_fwd_ws_kernel`): Q and dO arrive by TMA and the compiler splits
    the program's ``BLOCK_N`` keys between two consumer warp groups.

    One specialized loop walks (query head of the group, query block) pairs. Query rows past
    ``seqlen_q`` (read from the next batch, or zeros) get ``lse = EMPTY_LSE`` and so ``p = 0``;
    key rows past ``seqlen_k`` are computed and not stored.
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
    lo = 0
    if CAUSAL:  # the first query block that sees this program's first key
        lo = tl.maximum(start_n * BLOCK_N - q_pos_offset, 0) // BLOCK_M * BLOCK_M
    blocks = tl.cdiv(seqlen_q - lo, BLOCK_M)
    for it in tl.range(0, group * blocks, warp_specialize=True):
        off_h = off_hk * group + it // blocks
        start_m = lo + (it % blocks) * BLOCK_M
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

    offs_d = tl.arange(0, HEAD_DIM)
    rows_k = (off_b * seqlen_k + offs_n[:, None]) * (num_kv_heads * HEAD_DIM)
    ptrs = rows_k + off_hk * HEAD_DIM + offs_d[None, :]
    tl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < seqlen_k)
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < seqlen_k)


# -- backward dQ, warp-specialized (Hopper) --------------------------------------------------


@compile_directly
@triton.jit
def flash_attention_bwd_dq_ws_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    sm_scale,
    soft_cap,
    batch,
    seqlen_q,
    seqlen_k,
    num_heads,
    num_kv_heads,
    stats_len,
    DQ,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
):
    """The dQ kernel for the plain case, written for Triton's Hopper warp specialization (as
    :func:`flash_attention_fwd_ws_kernel`, whose loop it follows): K and V arrive by TMA and
    the compiler splits the program's ``BLOCK_M`` query rows between two consumer warp groups.

    ``Lse``/``Delta`` come as ``[B, H, stats_len]`` (``stats_len`` a multiple of ``BLOCK_M``,
    so every TMA offset is 16-byte aligned). Query rows past ``seqlen_q`` are computed from
    the padding (or the next batch's rows) and not stored; key rows past ``seqlen_k`` (the
    next batch's, or zeros) are masked like the forward's. ``HEAD_GROUP``: the program order
    of :func:`_program_tile`.
    """
    start_m, off_bh = _program_tile(HEAD_GROUP)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    off_hk = off_h // (num_heads // num_kv_heads)
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
    end = seqlen_k
    if CAUSAL:
        end = tl.maximum(tl.minimum(start_m * BLOCK_M + BLOCK_M + q_pos_offset, seqlen_k), 0)
    k_row = off_b * seqlen_k
    for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
        k = k_desc.load([k_row + start_n, off_hk * HEAD_DIM])
        s, t = _scores(tl.dot(q, tl.trans(k)), sm_scale, soft_cap, SOFT_CAP)
        s = _ws_mask(s, start_n, offs_m, q_pos_offset, seqlen_k, BLOCK_N, CAUSAL, EVEN_K)
        p = tl.exp2(s - lse[:, None])
        v = v_desc.load([k_row + start_n, off_hk * HEAD_DIM])
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        if SOFT_CAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq)

    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = (off_b * seqlen_q + offs_m[:, None]) * (num_heads * HEAD_DIM) + off_h * HEAD_DIM
    tl.store(
        DQ + ptrs + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=offs_m[:, None] < seqlen_q,
    )
