"""Triton multi-head latent attention, absorbed form, forward (signatures in jax-triton's
order: inputs, outputs, constexprs).

With ``W_kc`` folded into the query (``q_lat = q_nope · W_kcᵀ``, ``[B, Sq, Hq, R]``) every
head attends to the *shared* latent: logits ``q_lat · cᵀ + q_rope · k_ropeᵀ`` and values the
latent itself, so each cached token is read once for all heads, as its ``R + Dr`` features
(DeepSeek-V2, Sec. 2.1.2, "absorbed" matrices). The caller applies ``W_vc`` to the latent output.

:func:`mla_absorbed_fwd_kernel`, one program per block of ``BLOCK_M`` (query, head) rows of one
batch row (rows ``i · Hq + h``; decode has one query, so a block is ``BLOCK_M`` heads) and
split of the keys (a few rows over a long context are split over several programs, whose
partial outputs the caller merges by their log-sum-exp), walks the key blocks its rows can see
in its split with an online softmax in the log2 domain: scores through the
flash kernels' :func:`~ejkernel_triton.kernels.flash_attention_common._scores` (scale, soft
cap) and :func:`~ejkernel_triton.kernels.flash_attention_common._visible` (bottom-right
causal, sliding window: :mod:`ejkernel.attention_semantics`), a float32 ``[BLOCK_M, R]``
accumulator. Non-finite latent and rotary-key entries read as 0
(:func:`~ejkernel_triton.kernels.flash_attention_common._finite_or_zero`: the spec reads them so
before any projection): the rotary keys are cleaned as they load; the latent tiles go to the
matrix instructions as loaded (cleaning them would take each tile through registers and back
to shared memory), and a block whose accumulator ends non-finite (a NaN or Inf latent entry
reaches every row of the block through ``P·C``, as ``0·NaN`` where it is hidden) walks its
keys again with the latent cleaned. A row that sees no key gives zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    MASK_VALUE,
    _finite_or_zero,
    _scores,
    _visible,
)


@triton.jit
def mla_absorbed_fwd_kernel(
    q_ptr,
    qr_ptr,
    c_ptr,
    kr_ptr,
    sm_scale,
    soft_cap,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    num_heads,
    o_ptr,
    lse_ptr,
    R: tl.constexpr,
    DR: tl.constexpr,
    BR: tl.constexpr,
    BDR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(Sq · Hq, BLOCK_M), B, splits)``: from ``q_lat [B, Sq, Hq, R]``,
    ``q_rope [B, Sq, Hq, Dr]``, the latent ``[B, Sk, R]`` and ``k_rope [B, Sk, Dr]``
    (``DR = 0``: no rotary part), each split's normalised ``o_lat [splits, B, Sq, Hq, R]`` over
    its share of the keys and its log2-sum-exp ``[splits, B, Sq, Hq]`` (float32; a split whose
    rows see no key stores zeros and ``-EMPTY_LSE``)."""
    i_m, i_b, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    n_rows = seqlen_q * num_heads
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = rows < n_rows
    qi = rows // num_heads
    o_r = tl.arange(0, BR)
    m_r = o_r < R
    row_base = i_b.to(tl.int64) * n_rows + rows
    out_base = (i_s * tl.num_programs(1) + i_b).to(tl.int64) * n_rows + rows
    b_q = tl.load(
        q_ptr + row_base[:, None] * R + o_r[None, :], mask=m_rows[:, None] & m_r[None, :], other=0.0
    )
    o_d = tl.arange(0, BDR)
    m_d = o_d < DR
    b_qr = tl.load(
        qr_ptr + row_base[:, None] * DR + o_d[None, :],
        mask=m_rows[:, None] & m_d[None, :] & (DR > 0),
        other=0.0,
    )
    # the keys the block's rows may see
    offset = seqlen_k - seqlen_q
    first_q = (i_m * BLOCK_M) // num_heads
    last_q = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // num_heads, seqlen_q - 1)
    hi = seqlen_k
    lo = 0
    if CAUSAL:
        hi = tl.minimum(hi, last_q + offset + 1)
    if WINDOW:
        hi = tl.minimum(hi, last_q + offset + window_right + 1)
        lo = tl.maximum(0, first_q + offset - window_left)
        lo = (lo // BLOCK_N) * BLOCK_N
    # this split's share: whole key blocks, consecutive
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), splits) * BLOCK_N
    lo = lo + i_s * per_split
    hi = tl.minimum(hi, lo + per_split)
    geo = (offset, seqlen_q, seqlen_k, window_left, window_right)
    c_base = c_ptr + i_b.to(tl.int64) * seqlen_k * R
    kr_base = kr_ptr + i_b.to(tl.int64) * seqlen_k * DR
    walk = (
        (b_q, b_qr, qi),
        (c_base, kr_base, o_r, m_r, o_d, m_d),
        (lo, hi, seqlen_k),
        (sm_scale, soft_cap, geo),
    )
    m_i, l_i, acc = _walk(
        walk, R, DR, BLOCK_M, BR, BLOCK_N, CAUSAL, WINDOW, SOFT_CAP, DOT_PRECISION, CLEAN=False
    )
    # a non-finite latent entry turns its column of every row's accumulator non-finite
    # (0 · NaN, 0 · Inf): then the block walks again with the latent cleaned
    broken = tl.sum(tl.where((acc == acc) & (tl.abs(acc) != float("inf")), 0, 1))
    if broken > 0:
        m_i, l_i, acc = _walk(
            walk, R, DR, BLOCK_M, BR, BLOCK_N, CAUSAL, WINDOW, SOFT_CAP, DOT_PRECISION, CLEAN=True
        )
    seen = l_i > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptr + out_base[:, None] * R + o_r[None, :], out, mask=m_rows[:, None] & m_r[None, :])
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), -EMPTY_LSE)
    tl.store(lse_ptr + out_base, lse, mask=m_rows)


@triton.jit
def _walk(
    walk,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CLEAN: tl.constexpr,
):
    """The online softmax over the key blocks ``[lo, hi)``: ``(m, l, acc)``. ``walk`` holds the
    block's query rows, the latent and rotary-key bases with their offsets and masks, the key
    range and the scores' scale, cap and geometry. Rotary keys always read non-finite entries
    as 0; latent rows only with ``CLEAN`` (else they go to the matrix instructions as loaded)."""
    rows, keys, span, scores = walk
    b_q, b_qr, qi = rows
    c_base, kr_base, o_r, m_r, o_d, m_d = keys
    lo, hi, seqlen_k = span
    sm_scale, soft_cap, geo = scores
    masks = ((c_base, 0, 0), (c_base, 0, 0), (c_base, c_base))  # no bias, mask or segments
    features = (CAUSAL, WINDOW, False, False, False)
    m_i = tl.full([BLOCK_M], MASK_VALUE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BR], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kj = start + tl.arange(0, BLOCK_N)
        m_k = kj < seqlen_k
        b_c = tl.load(
            c_base + kj[:, None] * R + o_r[None, :], mask=m_k[:, None] & m_r[None, :], other=0.0
        )
        if CLEAN:
            b_c = _finite_or_zero(b_c)
        qk = tl.dot(b_q, tl.trans(b_c), input_precision=DOT_PRECISION)
        if DR > 0:
            b_kr = tl.load(
                kr_base + kj[:, None] * DR + o_d[None, :],
                mask=m_k[:, None] & m_d[None, :],
                other=0.0,
            )
            qk += tl.dot(b_qr, tl.trans(_finite_or_zero(b_kr)), input_precision=DOT_PRECISION)
        s, _ = _scores(qk, sm_scale, soft_cap, SOFT_CAP)
        s = _visible(s, qi[:, None], kj[None, :], geo, masks, True, features)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(s == MASK_VALUE, 0.0, tl.exp2(s - m_new[:, None]))
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_c.dtype), b_c, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc
