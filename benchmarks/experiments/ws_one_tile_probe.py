"""Probe: the warp-specialized forward as first written (one program per tile, the key loop
specialized), for the A/B against the persistent forward that replaced it (``ws_dq_ab.py``;
the one-tile dQ kernel of that A/B is the library's ``flash_attention_bwd_dq_ws_kernel``)."""

# ruff: noqa

import triton
import triton.language as tl

from ejkernel_triton._kernel_cache import compile_directly
from ejkernel_triton.kernels.flash_attention import (
    EMPTY_LSE,
    MASK_VALUE,
    _head_rows,
    _scores,
)


@compile_directly
@triton.jit
def fwd_ws_one_tile(
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
    power of two), written for Triton's Hopper warp specialization: K/V arrive by TMA, the key
    loop carries ``warp_specialize=True``, and the compiler splits the program into a producer
    warp group and two consumer warp groups of ``BLOCK_M / 2`` rows each.

    One loop over all visible key blocks, each masked when ``CAUSAL`` or a cut last block
    (``EVEN_K`` false) needs it: the pass rejects a second specialized loop. Rows and blocks
    are addressed in 2-D views ``[B·S, H·D]``; a key block that runs into the next batch's rows
    is masked like one past the end, and query rows past ``seqlen_q`` are never stored.
    """
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    off_hk = off_h // (num_heads // num_kv_heads)
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = q_desc.load([off_b * seqlen_q + start_m * BLOCK_M, off_h * HEAD_DIM])
    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = seqlen_k
    if CAUSAL:
        end = tl.maximum(tl.minimum(start_m * BLOCK_M + BLOCK_M + q_pos_offset, seqlen_k), 0)
    k_row = off_b * seqlen_k
    for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
        k = k_desc.load([k_row + start_n, off_hk * HEAD_DIM])
        s, _ = _scores(tl.dot(q, tl.trans(k)), sm_scale, soft_cap, SOFT_CAP)
        if CAUSAL:  # for a stored row, a causally visible key is also inside seqlen_k
            cols = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(cols[None, :] <= offs_m[:, None] + q_pos_offset, s, MASK_VALUE)
        elif not EVEN_K:
            cols = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(cols[None, :] < seqlen_k, s, MASK_VALUE)
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
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = (
        Out
        + (off_b * seqlen_q + offs_m[:, None]) * (num_heads * HEAD_DIM)
        + off_h * HEAD_DIM
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seqlen_q)
    tl.store(Lse + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
