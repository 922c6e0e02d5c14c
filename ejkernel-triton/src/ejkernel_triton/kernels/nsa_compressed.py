"""Triton native sparse attention, the compressed branch: forward, the selection scores and
backward (signatures in jax-triton's order: inputs, outputs, constexprs).

The compressed tokens ``kc [B, TC, Hkv, D]``, ``vc [B, TC, Hkv, Dv]`` are the mean-pooled
complete blocks of every sequence, sequence by sequence (built in JAX). Query token ``t``
sees the ``cnt[t]`` compressed tokens from ``lo[t]`` on: the complete blocks of its own
sequence that end at or before it. One program per (query token, batch row, KV head) holds
the ``G`` query heads of the group as the rows of one tile, as the selected branch's kernels
(:mod:`ejkernel_triton.kernels.nsa_selected`) do. Everything runs in float32 (the compressed
tokens are float32 means; the selection's scores come from these probabilities).

- :func:`nsa_compressed_fwd_kernel`: an online softmax in the log2 domain over the visible
  compressed tokens, ``BM`` at a time: float32 output and log2-sum-exp (a row that sees none:
  zeros and ``EMPTY_LSE``).
- :func:`nsa_compressed_scores_kernel`: each visible block's probability, averaged over the
  group's heads (the selection's score, NSA Sec. 3.3.2), ``[B, S, Hkv, NB]``.
- :func:`nsa_compressed_bwd_dq_kernel`: ``dq`` from the log2-sum-exp (FlashAttention-2's
  backward algebra).
- :func:`nsa_compressed_bwd_dkv_kernel`: ``dkc``, ``dvc``, one program per (``BM`` compressed
  tokens, ``TQ`` query tokens), walking the queries ``BT`` tokens at a time and adding its sums
  into float32 buffers once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE, LOG2E
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
def _compressed_rows(lo_ptr, cnt_ptr, t, m0, i_b, i_h, TC, HKV, BM: tl.constexpr):
    """The flat ``kc``/``vc`` rows of compressed tokens ``m0 .. m0 + BM`` of query ``t``'s
    range and which of them it sees."""
    lo = tl.load(lo_ptr + t)
    cnt = tl.load(cnt_ptr + t)
    o_m = m0 + tl.arange(0, BM)
    seen = o_m < cnt
    rows = (i_b.to(tl.int64) * TC + lo + tl.where(seen, o_m, 0)) * HKV + i_h
    return rows, seen, o_m


@triton.jit
def nsa_compressed_fwd_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    lo_ptr,
    cnt_ptr,
    scale,
    S,
    TC,
    HKV,
    o_ptr,
    lse_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(S, B·Hkv)``: the compressed branch's output ``[B, S, Hq, Dv]`` and
    log2-sum-exp ``[B, S, Hq]`` (float32)."""
    t, i_b, i_h, o_d, o_dv, q_rows, m_g, p_q, m_q, p_o, m_o = group_tiles(
        S, HKV, G, D, DV, BG, BD, BDV
    )
    b_q = tl.load(q_ptr + p_q, mask=m_q, other=0.0).to(tl.float32)
    qk_scale = scale * LOG2E
    m_i, l_i, acc = softmax_init(BG, BDV)
    cnt = tl.load(cnt_ptr + t)
    for m0 in range(0, cnt, BM):
        rows, seen, _ = _compressed_rows(lo_ptr, cnt_ptr, t, m0, i_b, i_h, TC, HKV, BM)
        b_k, b_v = load_kv(kc_ptr, vc_ptr, rows, seen, o_d, o_dv, D, DV)
        m_i, l_i, acc = softmax_step(b_q, b_k, b_v, seen, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    store_softmax(o_ptr, lse_ptr, p_o, m_o, q_rows, m_g, m_i, l_i, acc)


@triton.jit
def nsa_compressed_scores_kernel(
    q_ptr,
    kc_ptr,
    lo_ptr,
    cnt_ptr,
    lse_ptr,
    scale,
    S,
    TC,
    HKV,
    NB,
    p_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(S, B·Hkv)``: ``p [B, S, Hkv, NB]`` (float32, zeroed by the caller): the
    probability of each visible block ``c`` (compressed token ``lo + c``) averaged over the
    group's heads."""
    t, i_b, i_h, o_d, _, q_rows, m_g, p_q, m_q, _, _ = group_tiles(S, HKV, G, D, DV, BG, BD, BDV)
    b_q = tl.load(q_ptr + p_q, mask=m_q, other=0.0).to(tl.float32)
    b_lse = tl.load(lse_ptr + q_rows, mask=m_g, other=EMPTY_LSE)
    qk_scale = scale * LOG2E
    out = p_ptr + ((i_b.to(tl.int64) * S + t) * HKV + i_h) * NB
    cnt = tl.load(cnt_ptr + t)
    for m0 in range(0, cnt, BM):
        rows, seen, o_m = _compressed_rows(lo_ptr, cnt_ptr, t, m0, i_b, i_h, TC, HKV, BM)
        b_k = load_rows(kc_ptr, rows, seen, o_d, D)
        s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.where(m_g[:, None] & seen[None, :], tl.exp2(s - b_lse[:, None]), 0.0)
        tl.store(out + o_m, tl.sum(p, axis=0) / G, mask=seen & (o_m < NB))


@triton.jit
def nsa_compressed_bwd_dq_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    lo_ptr,
    cnt_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    scale,
    S,
    TC,
    HKV,
    dq_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(S, B·Hkv)``: from the forward's inputs, ``do [B, S, Hq, Dv]``, its
    log2-sum-exp and ``delta = Σ do ⊙ o`` ``[B, S, Hq]``, ``dq [B, S, Hq, D]`` (float32)."""
    t, i_b, i_h, o_d, o_dv, q_rows, m_g, p_q, m_q, p_o, m_o = group_tiles(
        S, HKV, G, D, DV, BG, BD, BDV
    )
    b_q = tl.load(q_ptr + p_q, mask=m_q, other=0.0).to(tl.float32)
    b_do = tl.load(do_ptr + p_o, mask=m_o, other=0.0).to(tl.float32)
    b_lse, b_delta = load_lse_delta(lse_ptr, delta_ptr, q_rows, m_g)
    qk_scale = scale * LOG2E
    b_dq = tl.zeros([BG, BD], dtype=tl.float32)
    cnt = tl.load(cnt_ptr + t)
    for m0 in range(0, cnt, BM):
        rows, seen, _ = _compressed_rows(lo_ptr, cnt_ptr, t, m0, i_b, i_h, TC, HKV, BM)
        b_k, b_v = load_kv(kc_ptr, vc_ptr, rows, seen, o_d, o_dv, D, DV)
        b_dq = dq_step(b_dq, b_q, b_k, b_v, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION)
    tl.store(dq_ptr + p_q, b_dq * scale, mask=m_q)


@triton.jit
def nsa_compressed_bwd_dkv_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    lo_ptr,
    cnt_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    scale,
    S,
    TC,
    HKV,
    dkc_ptr,
    dvc_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BM: tl.constexpr,
    TQ: tl.constexpr,
    BT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(TC, BM), cdiv(S, TQ), B·Hkv)``: ``dkc [B, TC, Hkv, D]`` and
    ``dvc [B, TC, Hkv, Dv]`` (float32, zeroed by the caller, added into): compressed tokens
    ``BM`` from the program's first against query tokens ``TQ`` from its first; a query at
    ``t`` sees compressed token ``m`` where ``lo[t] ≤ m < lo[t] + cnt[t]``."""
    i_m, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // HKV, i_bh % HKV
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    o_dv = tl.arange(0, BDV)
    m_m = o_m < TC
    kv_rows = (i_b.to(tl.int64) * TC + tl.where(m_m, o_m, 0)) * HKV + i_h
    p_k, m_k, p_v, m_v, b_k, b_v, b_dk, b_dv = key_tiles(
        kc_ptr, vc_ptr, kv_rows, m_m, o_d, o_dv, D, DV
    )
    qk_scale = scale * LOG2E
    o_r, head, hq = query_heads(HKV, G, BT, BG)
    for t0 in range(i_t * TQ, tl.minimum(i_t * TQ + TQ, S), BT):
        t = t0 + o_r // BG
        ok = (t < S) & (head < G)
        lo = tl.load(lo_ptr + t, mask=ok, other=0)
        cnt = tl.load(cnt_ptr + t, mask=ok, other=0)
        q_rows = query_rows(i_b, i_h, t, head, S, hq, G)
        b_q = load_rows(q_ptr, q_rows, ok, o_d, D).to(tl.float32)
        b_do = load_rows(do_ptr, q_rows, ok, o_dv, DV).to(tl.float32)
        b_lse, b_delta = load_lse_delta(lse_ptr, delta_ptr, q_rows, ok)
        seen = (
            ok[:, None]
            & m_m[None, :]
            & (o_m[None, :] >= lo[:, None])
            & (o_m[None, :] < (lo + cnt)[:, None])
        )
        b_dk, b_dv = dkv_step(
            b_dk, b_dv, b_k, b_v, b_q, b_do, b_lse, b_delta, seen, qk_scale, DOT_PRECISION
        )
    add_dkv(dkc_ptr, dvc_ptr, p_k, m_k, p_v, m_v, b_dk, b_dv, scale)
