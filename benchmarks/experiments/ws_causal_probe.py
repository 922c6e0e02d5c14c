"""Probe kernels: the warp-specialized forward's causal case, ways to spend less on the mask
(for ``ws_causal_ab.py``). ``VARIANT``: 0 masks every block (the library kernel's way); 6 the
same with the comparison against a per-row limit; 7 no mask (wrong results: the mask's cost).
Not specialized by triton 3.6 (no longer 12 warps, or the pass fails): 1 masks only blocks
that cross the diagonal (a branch in the loop); 2-5 peel the diagonal blocks into a plain loop
or step before or after the specialized loop. ``REVERSE`` launches query blocks longest
first. Sq = Sk, the plain case only."""

import triton
import triton.language as tl

from ejkernel_triton._kernel_cache import compile_directly
from ejkernel_triton.kernels.flash_attention import MASK_VALUE, _head_rows


@triton.jit
def _step(
    q,
    k_desc,
    v_desc,
    row,
    col,
    start_n,
    offs_m,
    m_i,
    l_i,
    acc,
    sm_scale,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
):
    k = k_desc.load([row + start_n, col])
    s = tl.dot(q, tl.trans(k)) * sm_scale
    if MASK == 1:
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(cols[None, :] <= offs_m[:, None], s, MASK_VALUE)
    elif MASK == 2:  # the row's last visible column, relative to the block: one add per row
        s = tl.where(tl.arange(0, BLOCK_N)[None, :] <= (offs_m - start_n)[:, None], s, MASK_VALUE)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([row + start_n, col])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@compile_directly
@triton.jit
def fwd_causal_probe(
    Q,
    K,
    V,
    sm_scale,
    batch,
    seqlen,
    num_heads,
    Out,
    GlobalScratch,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr,
    REVERSE: tl.constexpr,
):
    start_m = tl.program_id(0)
    if REVERSE:
        start_m = tl.num_programs(0) - 1 - start_m
    off_bh = tl.program_id(1)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    q_desc = _head_rows(Q, batch * seqlen, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen, num_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen, num_heads, HEAD_DIM, BLOCK_N)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = q_desc.load([off_b * seqlen + start_m * BLOCK_M, off_h * HEAD_DIM])
    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row = off_b * seqlen
    col = off_h * HEAD_DIM
    end = tl.minimum(start_m * BLOCK_M + BLOCK_M, seqlen)
    full = start_m * BLOCK_M // BLOCK_N * BLOCK_N  # blocks below the diagonal
    if VARIANT == 0:
        for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 1
            )
    elif VARIANT == 1:
        for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            k = k_desc.load([row + start_n, col])
            s = tl.dot(q, tl.trans(k)) * sm_scale
            if start_n >= full:
                cols = start_n + tl.arange(0, BLOCK_N)
                s = tl.where(cols[None, :] <= offs_m[:, None], s, MASK_VALUE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = v_desc.load([row + start_n, col])
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
    elif VARIANT == 6:
        for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 2
            )
    elif VARIANT == 7:  # no mask at all (wrong results: the cost of the mask)
        for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 0
            )
    elif VARIANT == 3:  # the specialized loop first, then the diagonal blocks
        for start_n in tl.range(0, full, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 0
            )
        for start_n in tl.range(full, end, BLOCK_N):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 1
            )
    elif VARIANT == 4:  # BLOCK_M == BLOCK_N: one diagonal block, no second loop, after
        for start_n in tl.range(0, full, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 0
            )
        m_i, l_i, acc = _step(
            q, k_desc, v_desc, row, col, full, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 1
        )
    elif VARIANT == 5:  # ... before
        m_i, l_i, acc = _step(
            q, k_desc, v_desc, row, col, full, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 1
        )
        for start_n in tl.range(0, full, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 0
            )
    else:
        for start_n in tl.range(full, end, BLOCK_N):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 1
            )
        for start_n in tl.range(0, full, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _step(
                q, k_desc, v_desc, row, col, start_n, offs_m, m_i, l_i, acc, sm_scale, BLOCK_N, 0
            )
    out = acc / l_i[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = Out + (row + offs_m[:, None]) * (num_heads * HEAD_DIM) + col + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seqlen)


@compile_directly
@triton.jit
def fwd_causal_persistent_probe(
    Q,
    K,
    V,
    sm_scale,
    batch,
    seqlen,
    num_heads,
    Out,
    GlobalScratch,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    BRANCH: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Persistent: ``num_programs(0)`` programs walk the (query block, batch·head) tiles,
    longest first, in an outer loop that carries ``warp_specialize=True``; the key loop inside
    is plain. Causal: one masked loop (``SPLIT``, whole blocks and the diagonal block in two
    loops, fails in the pass; ``BRANCH``, the mask behind a branch, is not specialized)."""
    num_m = tl.cdiv(seqlen, BLOCK_M)
    tiles = num_m * batch * num_heads
    q_desc = _head_rows(Q, batch * seqlen, num_heads, HEAD_DIM, BLOCK_M)
    k_desc = _head_rows(K, batch * seqlen, num_heads, HEAD_DIM, BLOCK_N)
    v_desc = _head_rows(V, batch * seqlen, num_heads, HEAD_DIM, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), warp_specialize=True):
        start_m = tile // (batch * num_heads)
        if CAUSAL:
            start_m = num_m - 1 - start_m  # longest first
        off_bh = tile % (batch * num_heads)
        off_b = off_bh // num_heads
        off_h = off_bh % num_heads
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row = off_b * seqlen
        col = off_h * HEAD_DIM
        q = q_desc.load([row + start_m * BLOCK_M, col])
        m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = tl.minimum(start_m * BLOCK_M + BLOCK_M, seqlen)
        if SPLIT:
            full = start_m * BLOCK_M // BLOCK_N * BLOCK_N
            for start_n in tl.range(0, full, BLOCK_N):
                m_i, l_i, acc = _step(
                    q,
                    k_desc,
                    v_desc,
                    row,
                    col,
                    start_n,
                    offs_m,
                    m_i,
                    l_i,
                    acc,
                    sm_scale,
                    BLOCK_N,
                    0,
                )
            for start_n in tl.range(full, end, BLOCK_N):
                m_i, l_i, acc = _step(
                    q,
                    k_desc,
                    v_desc,
                    row,
                    col,
                    start_n,
                    offs_m,
                    m_i,
                    l_i,
                    acc,
                    sm_scale,
                    BLOCK_N,
                    1,
                )
        elif BRANCH:  # one loop, the mask behind a branch
            full = start_m * BLOCK_M // BLOCK_N * BLOCK_N
            for start_n in tl.range(0, end, BLOCK_N):
                k = k_desc.load([row + start_n, col])
                s = tl.dot(q, tl.trans(k)) * sm_scale
                if start_n >= full:
                    cols = start_n + tl.arange(0, BLOCK_N)
                    s = tl.where(cols[None, :] <= offs_m[:, None], s, MASK_VALUE)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                v = v_desc.load([row + start_n, col])
                acc = tl.dot(p.to(v.dtype), v, acc)
                m_i = m_new
        elif CAUSAL:
            for start_n in tl.range(0, end, BLOCK_N):
                m_i, l_i, acc = _step(
                    q,
                    k_desc,
                    v_desc,
                    row,
                    col,
                    start_n,
                    offs_m,
                    m_i,
                    l_i,
                    acc,
                    sm_scale,
                    BLOCK_N,
                    1,
                )
        else:
            for start_n in tl.range(0, seqlen, BLOCK_N):
                m_i, l_i, acc = _step(
                    q,
                    k_desc,
                    v_desc,
                    row,
                    col,
                    start_n,
                    offs_m,
                    m_i,
                    l_i,
                    acc,
                    sm_scale,
                    BLOCK_N,
                    0,
                )
        out = acc / l_i[:, None]
        offs_d = tl.arange(0, HEAD_DIM)
        o_ptrs = Out + (row + offs_m[:, None]) * (num_heads * HEAD_DIM) + col + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seqlen)
