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

from ejkernel_triton.kernels.flash_attention_common import LOG2E
from ejkernel_triton.kernels.nsa_common import (
    add_dkv,
    dkv_step,
    dq_step,
    group_tiles,
    key_tiles,
    load_kv,
    load_lse_delta,
    load_rows,
    query_heads,
    query_rows,
    softmax_init,
    softmax_step,
    store_softmax,
)


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
    m_i, l_i, acc = softmax_init(BG, BDV)
    for i in range(T):
        rows, seen = _block_rows(idx_ptr, start_ptr, t, i_b, i_h, i, S, HKV, T, o_u, BS_TRUE)
        b_k, b_v = load_kv(k_ptr, v_ptr, rows * HKV + i_h, seen, o_d, o_dv, D, DV)
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
    b_lse, b_delta = load_lse_delta(lse_ptr, delta_ptr, q_rows, m_g)
    o_u = tl.arange(0, BS)
    qk_scale = scale * LOG2E
    b_dq = tl.zeros([BG, BD], dtype=tl.float32)
    for i in range(T):
        rows, seen = _block_rows(idx_ptr, start_ptr, t, i_b, i_h, i, S, HKV, T, o_u, BS_TRUE)
        b_k, b_v = load_kv(k_ptr, v_ptr, rows * HKV + i_h, seen, o_d, o_dv, D, DV)
        b_dq = dq_step(b_dq, b_q, b_k, b_v, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION)
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
        p_k, m_k, p_v, m_v, b_k, b_v, b_dk, b_dv = key_tiles(
            k_ptr, v_ptr, kv_rows, m_u, o_d, o_dv, D, DV
        )
        qk_scale = scale * LOG2E
        o_r, head, hq = query_heads(HKV, G, BT, BG)
        for p0 in range(lo, hi, BT):
            pair = p0 + o_r // BG
            ok = (pair < hi) & (head < G)
            t = tl.load(tok_ptr + i_bh.to(tl.int64) * NPAIRS + pair, mask=ok, other=0)
            q_rows = query_rows(i_b, i_h, t, head, S, hq, G)
            b_q = load_rows(q_ptr, q_rows, ok, o_d, D)
            b_do = load_rows(do_ptr, q_rows, ok, o_dv, DV)
            b_lse, b_delta = load_lse_delta(lse_ptr, delta_ptr, q_rows, ok)
            seen = ok[:, None] & m_u[None, :] & (key_rows[None, :] <= t[:, None])
            b_dk, b_dv = dkv_step(
                b_dk, b_dv, b_k, b_v, b_q, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION
            )
        add_dkv(dk_ptr, dv_ptr, p_k, m_k, p_v, m_v, b_dk, b_dv, scale)
