"""Triton native sparse attention, the selected branch: forward and backward (signatures in
jax-triton's order: inputs, outputs, constexprs).

One program per (query token, batch row, KV head) holds the ``G`` query heads of the KV head's
group as the rows of one tile (the selection is shared by the group, NSA Sec. 3.3.2) and walks
the group's ``T`` selected blocks: block ``c`` of the query's sequence is the key rows
``start + c·bs + u`` (``u < bs``), of which those at positions ≤ the query's own are visible
(the current block up to the query). Slots the caller left empty (negative, a repeat of an
earlier slot) or whose block starts after the query see nothing. Hidden rows are never loaded,
so what they hold cannot reach a row; the caller passes keys and values whose non-finite
entries already read as 0 (:func:`ejkernel.attention_semantics.finite_or_zero`).

- :func:`nsa_selected_fwd_kernel`: an online softmax in the log2 domain over the blocks, float32
  output and log2-sum-exp (a row that sees no key: zeros and ``EMPTY_LSE``).
- :func:`nsa_selected_bwd_kernel`: ``dq``; recomputes each block's probabilities from the
  log2-sum-exp (FlashAttention-2's backward algebra) and keeps the group's ``dq`` in registers.
- :func:`nsa_selected_bwd_dkv_kernel`: ``dk``/``dv``, one program per work item: a run of at
  most ``P`` (query token, block) pairs that share the block, from the pairs sorted by block
  (built in JAX); it holds the block's keys and values, walks its queries ``BT`` tokens at a
  time and adds its sums into float32 buffers once (a block most queries select, the first
  one say, spreads over several items, each one atomic add).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE, LOG2E, MASK_VALUE


@triton.jit
def group_tiles(
    S,
    HKV,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
):
    """The program's query token, batch row and KV head, its ``BG`` flat query rows and their
    mask, and the offsets and masks of its ``[BG, BD]`` query and ``[BG, BDV]`` output tiles."""
    t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    o_dv = tl.arange(0, BDV)
    m_g = o_g < G
    hq = HKV * G
    q_rows = (i_b.to(tl.int64) * S + t) * hq + i_h * G + o_g
    p_q = q_rows[:, None] * D + o_d[None, :]
    m_q = m_g[:, None] & (o_d < D)[None, :]
    p_o = q_rows[:, None] * DV + o_dv[None, :]
    m_o = m_g[:, None] & (o_dv < DV)[None, :]
    return t, i_b, i_h, o_d, o_dv, q_rows, m_g, p_q, m_q, p_o, m_o


@triton.jit
def _block_rows(
    idx_ptr,
    start_ptr,
    t,
    i_b,
    i_h,
    i,
    S,
    HKV,
    T,
    o_u,
    BS_TRUE: tl.constexpr,
):
    """Slot ``i``'s key rows ``[BS]`` (flat ``(batch row, token)`` indices) and which of them
    the query at ``t`` sees."""
    c = tl.load(idx_ptr + ((i_b.to(tl.int64) * S + t) * HKV + i_h) * T + i)
    start = tl.load(start_ptr + t)
    pos = t - start
    key_pos = c * BS_TRUE + o_u
    seen = (c >= 0) & (o_u < BS_TRUE) & (key_pos <= pos)
    rows = i_b.to(tl.int64) * S + start + tl.where(seen, key_pos, 0)
    return rows, seen


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
def nsa_selected_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    start_ptr,
    scale,
    S,
    HKV,
    T,
    o_ptr,
    lse_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BS_TRUE: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(S, B·Hkv)``: from ``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]``,
    ``v [B, S, Hkv, Dv]``, the selection ``[B, S, Hkv, T]`` (int32, each block once, -1 empty)
    and each token's sequence start ``[S]`` (int32), the selected branch's output
    ``[B, S, Hq, Dv]`` and log2-sum-exp ``[B, S, Hq]`` (float32)."""
    t, i_b, i_h, o_d, o_dv, q_rows, m_g, p_q, m_q, p_o, m_o = group_tiles(
        S, HKV, G, D, DV, BG, BD, BDV
    )
    b_q = tl.load(q_ptr + p_q, mask=m_q, other=0.0)
    o_u = tl.arange(0, BS)
    qk_scale = scale * LOG2E
    m_i = tl.full([BG], MASK_VALUE, dtype=tl.float32)
    l_i = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BDV], dtype=tl.float32)
    for i in range(T):
        rows, seen = _block_rows(idx_ptr, start_ptr, t, i_b, i_h, i, S, HKV, T, o_u, BS_TRUE)
        kv_rows = rows * HKV + i_h
        b_k = tl.load(
            k_ptr + kv_rows[:, None] * D + o_d[None, :],
            mask=seen[:, None] & (o_d < D)[None, :],
            other=0.0,
        )
        b_v = tl.load(
            v_ptr + kv_rows[:, None] * DV + o_dv[None, :],
            mask=seen[:, None] & (o_dv < DV)[None, :],
            other=0.0,
        )
        m_i, l_i, acc = softmax_step(b_q, b_k, b_v, seen, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    store_softmax(o_ptr, lse_ptr, p_o, m_o, q_rows, m_g, m_i, l_i, acc)


@triton.jit
def nsa_selected_bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    start_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    scale,
    S,
    HKV,
    T,
    dq_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BS_TRUE: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(S, B·Hkv)``: from the forward's inputs, ``do [B, S, Hq, Dv]``, its
    log2-sum-exp and ``delta = Σ do ⊙ o`` ``[B, S, Hq]``, the gradient ``dq [B, S, Hq, D]``."""
    t, i_b, i_h, o_d, o_dv, q_rows, m_g, p_q, m_q, p_o, m_o = group_tiles(
        S, HKV, G, D, DV, BG, BD, BDV
    )
    b_q = tl.load(q_ptr + p_q, mask=m_q, other=0.0)
    b_do = tl.load(do_ptr + p_o, mask=m_o, other=0.0)
    b_lse = tl.load(lse_ptr + q_rows, mask=m_g, other=EMPTY_LSE)
    b_delta = tl.load(delta_ptr + q_rows, mask=m_g, other=0.0)
    o_u = tl.arange(0, BS)
    qk_scale = scale * LOG2E
    b_dq = tl.zeros([BG, BD], dtype=tl.float32)
    for i in range(T):
        rows, seen = _block_rows(idx_ptr, start_ptr, t, i_b, i_h, i, S, HKV, T, o_u, BS_TRUE)
        kv_rows = rows * HKV + i_h
        m_k = seen[:, None] & (o_d < D)[None, :]
        m_v = seen[:, None] & (o_dv < DV)[None, :]
        b_k = tl.load(k_ptr + kv_rows[:, None] * D + o_d[None, :], mask=m_k, other=0.0)
        b_v = tl.load(v_ptr + kv_rows[:, None] * DV + o_dv[None, :], mask=m_v, other=0.0)
        _, ds = probs_and_ds(
            b_q, b_k, b_v, b_do, b_lse, b_delta, seen[None, :], qk_scale, DOT_PRECISION
        )
        b_dq += tl.dot(ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)
    tl.store(dq_ptr + p_q, (b_dq * scale).to(dq_ptr.dtype.element_ty), mask=m_q)


@triton.jit
def nsa_selected_bwd_dkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    tok_ptr,
    items_ptr,
    scale,
    S,
    HKV,
    NPAIRS,
    W,
    dk_ptr,
    dv_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BS_TRUE: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BS: tl.constexpr,
    BT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(W, B·Hkv)``: ``dk [B, S, Hkv, D]`` and ``dv [B, S, Hkv, Dv]`` (float32, zeroed
    by the caller, added into) from the backward's inputs, the query token of each (query,
    block) pair in block order ``tok [B, Hkv, NPAIRS]`` and the work items
    ``[B, Hkv, W, 3]`` (int32): the block's first key row ``r0`` and the item's pairs
    ``[lo, hi)`` (empty where ``lo = hi``). Pair ``p``'s query at ``t = tok[p]`` sees the
    block's rows ``r0 + u ≤ t`` (``u < BS_TRUE``)."""
    w, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    item = items_ptr + (i_bh.to(tl.int64) * W + w) * 3
    r0, lo, hi = tl.load(item), tl.load(item + 1), tl.load(item + 2)
    if lo < hi:
        o_u = tl.arange(0, BS)
        o_d = tl.arange(0, BD)
        o_dv = tl.arange(0, BDV)
        key_rows = r0 + o_u
        m_u = (o_u < BS_TRUE) & (key_rows < S)
        kv_rows = (i_b.to(tl.int64) * S + key_rows) * HKV + i_h
        m_k = m_u[:, None] & (o_d < D)[None, :]
        m_v = m_u[:, None] & (o_dv < DV)[None, :]
        p_k = kv_rows[:, None] * D + o_d[None, :]
        p_v = kv_rows[:, None] * DV + o_dv[None, :]
        b_k = tl.load(k_ptr + p_k, mask=m_k, other=0.0)
        b_v = tl.load(v_ptr + p_v, mask=m_v, other=0.0)
        qk_scale = scale * LOG2E
        o_r = tl.arange(0, BT * BG)  # rows: BT pairs' BG query heads each
        head = o_r % BG
        hq = HKV * G
        b_dk = tl.zeros([BS, BD], dtype=tl.float32)
        b_dv = tl.zeros([BS, BDV], dtype=tl.float32)
        for p0 in range(lo, hi, BT):
            pair = p0 + o_r // BG
            ok = (pair < hi) & (head < G)
            t = tl.load(tok_ptr + i_bh.to(tl.int64) * NPAIRS + pair, mask=ok, other=0)
            q_rows = (i_b.to(tl.int64) * S + t) * hq + i_h * G + head
            b_q = tl.load(
                q_ptr + q_rows[:, None] * D + o_d[None, :],
                mask=ok[:, None] & (o_d < D)[None, :],
                other=0.0,
            )
            b_do = tl.load(
                do_ptr + q_rows[:, None] * DV + o_dv[None, :],
                mask=ok[:, None] & (o_dv < DV)[None, :],
                other=0.0,
            )
            b_lse = tl.load(lse_ptr + q_rows, mask=ok, other=EMPTY_LSE)
            b_delta = tl.load(delta_ptr + q_rows, mask=ok, other=0.0)
            seen = ok[:, None] & m_u[None, :] & (key_rows[None, :] <= t[:, None])
            p, ds = probs_and_ds(b_q, b_k, b_v, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION)
            b_dk += tl.dot(tl.trans(ds.to(b_q.dtype)), b_q, input_precision=DOT_PRECISION)
            b_dv += tl.dot(tl.trans(p.to(b_do.dtype)), b_do, input_precision=DOT_PRECISION)
        tl.atomic_add(dk_ptr + p_k, b_dk * scale, mask=m_k)
        tl.atomic_add(dv_ptr + p_v, b_dv, mask=m_v)
