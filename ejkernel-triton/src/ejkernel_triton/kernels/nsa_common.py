"""The tile steps that the Triton native sparse attention kernels of both branches share
(:mod:`ejkernel_triton.kernels.nsa_selected`, :mod:`ejkernel_triton.kernels.nsa_compressed`).

A query-side program holds the ``G`` query heads of one KV head's group, for one query token,
as the rows of a ``[BG, ·]`` tile; a key-side program (the ``dk``/``dv`` kernels) holds a run of
key rows and walks query rows ``BT·BG`` at a time. Arrays are row-major with flat rows: a
``[B, S, H, D]`` array's row ``(b·S + t)·H + h`` starts at element ``row·D``. Probabilities
live in the log2 domain (scores scaled by ``qk_scale = scale·log2 e``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE, MASK_VALUE


@triton.jit
def query_rows(i_b, i_h, t, head, S, hq, G):
    """The flat rows of ``[B, S, hq, ·]`` arrays for batch row ``i_b``, query token(s) ``t``
    and head ``head`` of KV head ``i_h``'s group."""
    return (i_b.to(tl.int64) * S + t) * hq + i_h * G + head


@triton.jit
def group_tiles(S, HKV, G, D, DV, BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """The program's query token, batch row and KV head, its ``BG`` flat query rows and their
    mask, and the offsets and masks of its ``[BG, BD]`` query and ``[BG, BDV]`` output tiles."""
    t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    o_dv = tl.arange(0, BDV)
    m_g = o_g < G
    hq = HKV * G
    q_rows = query_rows(i_b, i_h, t, o_g, S, hq, G)
    p_q = q_rows[:, None] * D + o_d[None, :]
    m_q = m_g[:, None] & (o_d < D)[None, :]
    p_o = q_rows[:, None] * DV + o_dv[None, :]
    m_o = m_g[:, None] & (o_dv < DV)[None, :]
    return t, i_b, i_h, o_d, o_dv, q_rows, m_g, p_q, m_q, p_o, m_o


@triton.jit
def load_rows(ptr, rows, ok, o_d, D):
    """The ``[len(rows), len(o_d)]`` tile of the ``[·, D]`` array at ``ptr``: flat rows
    ``rows``, columns ``o_d``; zeros in the rows where ``ok`` is false and past column ``D``."""
    return tl.load(
        ptr + rows[:, None] * D + o_d[None, :],
        mask=ok[:, None] & (o_d < D)[None, :],
        other=0.0,
    )


@triton.jit
def load_kv(k_ptr, v_ptr, rows, seen, o_d, o_dv, D, DV):
    """The key and value tiles of flat rows ``rows`` (zeros where ``seen`` is false)."""
    b_k = load_rows(k_ptr, rows, seen, o_d, D)
    b_v = load_rows(v_ptr, rows, seen, o_dv, DV)
    return b_k, b_v


@triton.jit
def load_lse_delta(lse_ptr, delta_ptr, q_rows, ok):
    """The log2-sum-exp and ``delta = Σ do ⊙ o`` of flat query rows ``q_rows`` (``EMPTY_LSE``
    and 0 where ``ok`` is false)."""
    b_lse = tl.load(lse_ptr + q_rows, mask=ok, other=EMPTY_LSE)
    b_delta = tl.load(delta_ptr + q_rows, mask=ok, other=0.0)
    return b_lse, b_delta


@triton.jit
def softmax_init(BG: tl.constexpr, BDV: tl.constexpr):
    """The online softmax's starting ``(m, l, acc)`` for ``BG`` rows of ``BDV`` channels."""
    m_i = tl.full([BG], MASK_VALUE, dtype=tl.float32)
    l_i = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BDV], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def softmax_step(b_q, b_k, b_v, seen, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One step of the online softmax (log2 domain) of the query tile over the key rows
    ``b_k`` / ``b_v`` of which those ``seen [BN]`` count: the new ``(m, l, acc)``."""
    s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(seen[None, :], s, MASK_VALUE)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(seen[None, :], tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_softmax(o_ptr, lse_ptr, p_o, m_o, q_rows, m_g, m_i, l_i, acc):
    """The online softmax's float32 output and log2-sum-exp; a row that sees no key gets
    zeros and ``EMPTY_LSE``."""
    seen_any = l_i > 0.0
    out = tl.where(seen_any[:, None], acc / tl.where(seen_any, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptr + p_o, out, mask=m_o)
    lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), EMPTY_LSE)
    tl.store(lse_ptr + q_rows, lse, mask=m_g)


@triton.jit
def probs_and_ds(b_q, b_k, b_v, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION: tl.constexpr):
    """FlashAttention-2's backward algebra on one tile: the probabilities recomputed from the
    log2-sum-exp (zero where ``seen``, a mask broadcastable to ``[rows, keys]``, is false) and
    ``ds = p ⊙ (do vᵀ − delta)``."""
    s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.where(seen, tl.exp2(s - b_lse[:, None]), 0.0)
    dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
    return p, p * (dp - b_delta[:, None])


@triton.jit
def dq_step(b_dq, b_q, b_k, b_v, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION: tl.constexpr):
    """``b_dq`` plus the unscaled ``ds k`` of the query tile against the key rows ``b_k`` /
    ``b_v`` of which those ``seen [BN]`` count."""
    _, ds = probs_and_ds(
        b_q, b_k, b_v, b_do, b_lse, b_delta, seen[None, :], qk_scale, DOT_PRECISION
    )
    return b_dq + tl.dot(ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)


@triton.jit
def key_tiles(k_ptr, v_ptr, kv_rows, m_rows, o_d, o_dv, D, DV):
    """The offsets and masks of a key-side program's ``[BN, BD]`` key and ``[BN, BDV]`` value
    tiles (flat rows ``kv_rows``, valid where ``m_rows``; channels ``o_d`` / ``o_dv``), the
    tiles, and float32 zeros of their shapes to sum ``dk`` and ``dv`` in."""
    m_k = m_rows[:, None] & (o_d < D)[None, :]
    m_v = m_rows[:, None] & (o_dv < DV)[None, :]
    p_k = kv_rows[:, None] * D + o_d[None, :]
    p_v = kv_rows[:, None] * DV + o_dv[None, :]
    b_k = tl.load(k_ptr + p_k, mask=m_k, other=0.0)
    b_v = tl.load(v_ptr + p_v, mask=m_v, other=0.0)
    b_dk = tl.zeros(b_k.shape, dtype=tl.float32)
    b_dv = tl.zeros(b_v.shape, dtype=tl.float32)
    return p_k, m_k, p_v, m_v, b_k, b_v, b_dk, b_dv


@triton.jit
def query_heads(HKV, G, BT: tl.constexpr, BG: tl.constexpr):
    """A key-side program's ``BT·BG`` query rows (``BT`` tokens' ``BG`` heads each), each
    row's head, and the number of query heads."""
    o_r = tl.arange(0, BT * BG)
    return o_r, o_r % BG, HKV * G


@triton.jit
def dkv_step(
    b_dk, b_dv, b_k, b_v, b_q, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION: tl.constexpr
):
    """``b_dk`` plus the unscaled ``dsᵀ q`` and ``b_dv`` plus ``pᵀ do`` of the key tile against
    a tile of query rows (``seen [rows, keys]`` the visible pairs)."""
    p, ds = probs_and_ds(b_q, b_k, b_v, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION)
    b_dk += tl.dot(tl.trans(ds.to(b_q.dtype)), b_q, input_precision=DOT_PRECISION)
    b_dv += tl.dot(tl.trans(p.to(b_do.dtype)), b_do, input_precision=DOT_PRECISION)
    return b_dk, b_dv


@triton.jit
def add_dkv(dk_ptr, dv_ptr, p_k, m_k, p_v, m_v, b_dk, b_dv, scale):
    """Add a key-side program's sums into the float32 ``dk`` (scaled by ``scale``) and ``dv``."""
    tl.atomic_add(dk_ptr + p_k, b_dk * scale, mask=m_k)
    tl.atomic_add(dv_ptr + p_v, b_dv, mask=m_v)
