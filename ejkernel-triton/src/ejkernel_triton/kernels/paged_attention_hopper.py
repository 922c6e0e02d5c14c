"""Paged attention for Hopper in Gluon: the query chunks of a ragged batch (prefill and
mixed batches) on flash attention's ping-pong schedule, with K and V gathered page by page.

The consumers are :mod:`ejkernel_triton.kernels.flash_attention_hopper_fwd`'s (two warp
groups of 64 query rows taking turns on the tensor cores, the online softmax, the masking of
cut blocks and the hidden-NaN rule); this module adds the loader and the program's place in
the batch:

- Layout as :mod:`ejkernel_triton.kernels.paged_attention`'s: packed queries ``[T, Hq, D]``,
  caches ``[num_pages, page_size, Hkv, D]``, ``block_tables [rows, max_pages]``,
  ``query_start_loc [rows + 1]``, ``kv_lens [rows]``; a sequence's queries are its last
  tokens (bottom-right causal).
- A program is 128 query tokens of one sequence and one query head. Grid ``(T // 128 +
  rows, Hq)``: query block ``b`` belongs to the last sequence ``s`` with
  ``query_start_loc[s] // 128 + s <= b`` (a binary search; blocks past a sequence's queries
  exit). Under a causal mask the blocks run longest first, in groups of ``HEAD_GROUP`` heads
  (flash attention's order). Sequences with fewer than ``MIN_Q_LEN`` queries are left to
  another launch (a mixed batch's decodes) and their tokens to zero.
- The loader warp brings a key block of ``BLOCK_N`` keys as ``BLOCK_N / PAGE_SIZE`` TMA copies
  of one page each into row slices of the ring's slot (or one copy of ``BLOCK_N`` rows of a
  page when pages are longer), over the cache seen as ``[num_pages · page_size, Hkv · D]``.
  Page ids come from the table, clamped to ``[0, num_pages)``; table slots past the
  sequence's live pages are never read (page 0 is copied instead, and masked).
- The tile's query rows past the sequence's queries belong to the next sequence (or lie past
  ``T``, where TMA reads zeros): computed, never stored.

The log2-sum-exp ``Lse`` is written per sequence as ``[Hq, q_len]`` at offset
``query_start_loc[s] · Hq`` (scratch; callers drop it). GPU only, as every Gluon kernel (the
CPU tests compile it for sm_90).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ejkernel_triton.kernels.flash_attention_common import _program_tile
from ejkernel_triton.kernels.flash_attention_hopper_fwd import (
    CONSUMER_REGS,
    HALF,
    LOADER_REGS,
    _consumer,
    _head_rows,
    _loader,
    _ring,
)
from ejkernel_triton.kernels.paged_attention import _sequence_of


@gluon.jit
def paged_attention_pingpong_kernel(
    Q,
    KCache,
    VCache,
    KvLens,
    Tables,
    QStart,
    NumSeqs,
    sm_scale,
    soft_cap,
    num_tokens,
    num_heads,
    num_kv_heads,
    num_pages,
    max_pages,
    Out,
    Lse,
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFT_CAP: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    MIN_Q_LEN: gl.constexpr,
    HEAD_GROUP: gl.constexpr = 0,
):
    """One program per (128-token query block of a sequence, query head): see the module
    docstring. ``NumSeqs``: the live sequences (int32 ``[1]``)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    COPY: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    block, h = _program_tile(HEAD_GROUP)
    seq = _sequence_of(QStart, gl.load(NumSeqs), block, 2 * HALF)
    if seq < 0:
        return
    q_start = gl.load(QStart + seq)
    q_len = gl.load(QStart + seq + 1) - q_start
    start_m = block - (q_start // (2 * HALF) + seq)
    if start_m * (2 * HALF) >= q_len or q_len < MIN_Q_LEN:
        return
    kv_len = gl.minimum(gl.maximum(gl.load(KvLens + seq), 0), max_pages * PAGE_SIZE)
    hi = kv_len
    if CAUSAL:  # the last key the block's last row sees
        hi = gl.maximum(gl.minimum(hi, (start_m + 1) * (2 * HALF) + kv_len - q_len), 0)
    n_blocks = gl.cdiv(hi, BLOCK_N)

    q_desc = _head_rows(Q, num_tokens, num_heads, HEAD_DIM, HALF, q_sl)
    pages_rows = num_pages * PAGE_SIZE
    k_desc = _head_rows(KCache, pages_rows, num_kv_heads, HEAD_DIM, COPY, kv_sl)
    v_desc = _head_rows(VCache, pages_rows, num_kv_heads, HEAD_DIM, COPY, kv_sl)
    smem, bars, turn = _ring(dtype, q_sl, kv_sl, HEAD_DIM, BLOCK_N, STAGES)

    group = num_heads // num_kv_heads
    token0 = q_start.to(gl.int64)
    tile = (
        Out + token0 * num_heads * HEAD_DIM,
        Lse + token0 * num_heads,
        sm_scale,
        soft_cap,
        q_len,
        kv_len,
        num_heads,
        start_m,
        0,
        h,
    )
    table_row = Tables + seq.to(gl.int64) * max_pages
    live_pages = gl.cdiv(kv_len, PAGE_SIZE)
    where = ((h // group) * HEAD_DIM, table_row, live_pages, num_pages)
    place = (q_start + start_m * (2 * HALF), h * HEAD_DIM, where)
    descs = (q_desc, k_desc, v_desc)
    gl.warp_specialize(
        [  # (constexprs inside a tuple variable would become tensors: spelled out each time)
            (_consumer, (smem, bars, turn, tile, n_blocks, 0, STAGES, CAUSAL, SOFT_CAP, False)),
            (_consumer, (smem, bars, turn, tile, n_blocks, 1, STAGES, CAUSAL, SOFT_CAP, False)),
            (_loader, (descs, smem, bars, place, n_blocks, STAGES, PAGE_SIZE)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


#: 3 warp groups at 168 registers each (65536 per SM), redistributed as 240 / 240 / 24
paged_attention_pingpong_kernel.ejkernel_compile_options = {"maxnreg": 168}
