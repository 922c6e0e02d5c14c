"""Triton: a chunk's intra-chunk products under a per-channel (vector) log gate (gla's
forward), and the sub-chunk constants every per-channel gate's kernels share (gla's and Kimi
Delta Attention's, forward and backward).

``channel_products`` builds ``P_tj = Σ_κ q_tκ k_jκ exp(G_tκ − G_jκ)`` (``j ≤ t``) for one
chunk in whole-chunk tiles: the decays factor through the first row of each row's block of
:data:`SUB` rows, and the diagonal blocks go entry by entry where that factor would not stay
finite (:data:`DIAGONAL_PRODUCT_SPAN`).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Rows per diagonal block of a per-channel gate's decayed products (the rest are products
#: factored through a block's first row).
SUB: tl.constexpr = tl.constexpr(16)

#: Largest log-decay span inside a sub-chunk whose diagonal block is one product through the
#: sub-chunk's first row: its factor ``exp(G_r − G_s)`` stays below ``e^60`` (finite in bf16
#: and float32) or, for float16 operands, ``e^8`` (float16 ends near ``e^11``); a wider span
#: takes the block entry by entry.
DIAGONAL_PRODUCT_SPAN: tl.constexpr = tl.constexpr(60.0)
DIAGONAL_PRODUCT_SPAN_F16: tl.constexpr = tl.constexpr(8.0)


@triton.jit
def channel_products(
    qn_ptr,
    kn_ptr,
    gc_ptr,
    first,
    H,
    o_c,
    K: tl.constexpr,
    C: tl.constexpr,
    BKP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NARROW: tl.constexpr,
    KEYS: tl.constexpr = True,
):
    """One chunk's ``P_tj = Σ_κ q_tκ k_jκ exp(G_tκ − G_jκ)`` and, with ``KEYS``, its decayed
    ``K Kᵀ`` likewise (``[C, C]`` float32, ``j ≤ t``: zero above the diagonal) for a
    per-channel cumulative log gate ``G``, from ``q``, ``k`` [B, T, H, K] (any float dtype)
    and ``G`` (float32) on the chunk layout (the chunk's rows start at flat row ``first``,
    ``H`` apart), over the key channels in blocks of ``BKP``. ``NARROW``: the products take
    operands in ``q``'s dtype (float32 otherwise).

    The decays factor through each row's block of :data:`SUB` rows: with ``ρ(t)`` the first
    row of row ``t``'s block, ``exp(G_t − G_s) = exp(G_t − G_ρ(t)) · exp(G_ρ(t) − G_s)``. The
    rows' factor is one ``[C, BKP]`` tile (at most 1); the columns' factor is taken once per
    row block ``r`` over the keys up to that block (at most 1 below the diagonal block), and
    ``P = Σ_r Q_r K_rᵀ`` with ``Q_r`` the rows of block ``r``, so every product is a whole
    chunk's. The diagonal blocks take the same factors where the key block's channels decay by
    at most :data:`DIAGONAL_PRODUCT_SPAN` across any block
    (``exp(G_ρ − G_s)`` then stays finite; the entries above the diagonal are selected away),
    and otherwise go entry by entry, one column of every block per step."""
    o_s = o_c % SUB
    blk = o_c // SUB
    lower = o_c[:, None] >= o_c[None, :]
    dt = qn_ptr.dtype.element_ty
    limit: tl.constexpr = (
        DIAGONAL_PRODUCT_SPAN_F16 if NARROW and dt == tl.float16 else DIAGONAL_PRODUCT_SPAN
    )
    rows = first + o_c * H
    refs = first + (blk * SUB) * H
    b_p = tl.zeros([C, C], dtype=tl.float32)
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BKP):
        o_k = k0 + tl.arange(0, BKP)
        m_k = (o_k < K)[None, :]
        p_k = rows[:, None] * K + o_k[None, :]
        b_q = tl.load(qn_ptr + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(kn_ptr + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(gc_ptr + p_k, mask=m_k, other=0.0)
        b_gref = tl.load(gc_ptr + refs[:, None] * K + o_k[None, :], mask=m_k, other=0.0)
        b_in = tl.exp(b_g - b_gref)
        b_qa = b_q * b_in
        b_ka = b_k * b_in
        if NARROW:
            b_qa, b_ka = b_qa.to(dt), b_ka.to(dt)
        diagonal = tl.max(b_gref - b_g) <= limit
        for r in tl.static_range(C // SUB):
            b_gr = tl.load(gc_ptr + (first + r * SUB * H) * K + o_k, mask=o_k < K, other=0.0)
            # a NaN reference (a NaN gate at or before it) makes block r's rows NaN through
            # their own factor; kept out of the columns, it stays out of the other blocks' rows
            b_gr = tl.where(b_gr == b_gr, b_gr, 0.0)
            seen = (blk < r + diagonal.to(tl.int32))[:, None]  # block r itself if diagonal
            b_kb = b_k * tl.exp(tl.where(seen, b_gr[None, :] - b_g, float("-inf")))
            in_r = (blk == r)[:, None]
            b_qr = tl.where(in_r, b_qa, 0.0)
            b_kr = tl.where(in_r, b_ka, 0.0)
            if NARROW:
                b_kb, b_qr, b_kr = b_kb.to(dt), b_qr.to(dt), b_kr.to(dt)
            b_p += tl.dot(b_qr, tl.trans(b_kb), input_precision=DOT_PRECISION)
            if KEYS:
                b_kk += tl.dot(b_kr, tl.trans(b_kb), input_precision=DOT_PRECISION)
        if not diagonal:
            same = blk[:, None] == blk[None, :]
            for s in range(0, SUB):
                p_s = (first + (blk * SUB + s) * H)[:, None] * K + o_k[None, :]
                b_ks = tl.load(kn_ptr + p_s, mask=m_k, other=0.0).to(tl.float32)
                b_gs = tl.load(gc_ptr + p_s, mask=m_k, other=0.0)
                b_ke = b_ks * tl.exp(tl.where((o_s >= s)[:, None], b_g - b_gs, float("-inf")))
                col = same & (o_s[None, :] == s)
                b_p = tl.where(col, b_p + tl.sum(b_q * b_ke, axis=1)[:, None], b_p)
                if KEYS:
                    b_kk = tl.where(col, b_kk + tl.sum(b_k * b_ke, axis=1)[:, None], b_kk)
    # selected: the entries above the diagonal (a NaN key's column among them) are zeros
    return tl.where(lower, b_p, 0.0), tl.where(lower, b_kk, 0.0)
