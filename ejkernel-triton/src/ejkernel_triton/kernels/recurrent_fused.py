"""Triton fused recurrent gated linear attention: one token at a time, for decoding.

One program per (value block, sequence, head) walks the sequence's tokens in order with the
state ``h [K, BV]`` in float32 registers: ``h ← h ⊙ exp(g_t)[:, None] + k_tᵀ v_t`` and
``o_t = scale · q_t h``, exactly the recurrence (a gate of −inf zeroes the state: a reset; a
NaN reaches only its causal future). The state is read once and written once, so for the few
tokens of a decoding step (T ≤ 16) the kernel moves little more than the state itself, where
the chunked kernels pad to a whole chunk and launch four times.

Tokens are ``[B, S, H, F]`` row-major (``F`` = K or V), the key gate ``g [B, S, H, K]``
float32; states ``[N, H, K, V]`` float32. Dense (``PACKED`` false) sequence ``n`` is batch row
``n``; packed, it is tokens ``[cu[n], cu[n + 1])`` of the single row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_walk(
    cu_ptr,
    S,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PACKED: tl.constexpr,
):
    """A token-by-token program's indices (grid ``(cdiv(V, BV), N, H)``): its head, its
    sequence's first and past-the-last flat tokens, the key/value offsets and masks, and the
    offsets of its ``[BK, BV]`` tile of the ``[N, H, K, V]`` states."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PACKED:
        bos = tl.load(cu_ptr + i_n).to(tl.int64)
        eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * S
        eos = bos + S
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    return i_h, bos, eos, o_k, o_v, m_k, m_v, m_kv, state


@triton.jit
def recurrent_fused_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    init_ptr,
    cu_ptr,
    scale,
    S,
    H,
    o_ptr,
    final_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PACKED: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N, H)``: the outputs of one sequence's tokens for one head and
    value block, and its final state (``BK`` is K rounded up to a power of two)."""
    i_h, bos, eos, o_k, o_v, m_k, m_v, m_kv, state = sequence_walk(
        cu_ptr, S, H, K, V, BK, BV, PACKED
    )
    b_h = tl.load(init_ptr + state, mask=m_kv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        row = t * H + i_h
        b_q = tl.load(q_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_h = b_h * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o_ptr + row * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(final_ptr + state, b_h, mask=m_kv)
