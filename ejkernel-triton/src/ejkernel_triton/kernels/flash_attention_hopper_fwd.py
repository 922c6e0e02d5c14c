"""Flash attention for Hopper in Gluon: the forward, scheduled as FlashAttention-3 (Shah et al.,
2024), a loader warp and two consumer warp groups that take turns on the tensor cores. The
backward (:mod:`ejkernel_triton.kernels.flash_attention_hopper_bwd`), dQ, dK and dV in one
kernel of a loader warp and two consumer warp groups, shares this module's helpers (both take
their constants and Triton helpers from :mod:`ejkernel_triton.kernels.flash_attention_common`);
both are described here.

Triton 3.6's automatic warp specialization (the ``*_ws_kernel`` functions of
:mod:`ejkernel_triton.kernels.flash_attention_fwd` and ``flash_attention_bwd``) splits a
program into a producer and two consumers but lets the consumers run freely: both reach their
softmax together and the tensor cores wait. Gluon (``triton.experimental.gluon``) writes the partitions out:

- the default partition and a 4-warp worker are the consumers, 64 query rows each of a
  128-row tile, with 240 registers per thread; the 1-warp loader keeps 24;
- the loader brings both halves of Q once and K/V blocks into a ring of ``STAGES`` slots by
  TMA (``k_ready``/``v_ready``); each consumer frees a K slot once its scores are computed and
  a V slot once its P·V is (``k_empty``/``v_empty`` count both consumers);
- ping-pong: two ``turn`` mbarriers pass the right to issue matmuls, so one consumer's softmax
  runs under the other's matmuls;
- within a consumer the scores of block j are issued with P·V of block j-1, and the softmax of
  block j runs while the latter finishes.

Same contract as ``flash_attention_fwd_ws_kernel``: the plain case (no bias, mask, segments,
window or sinks), bf16/f16, D = Dv a power of two; soft cap; GQA/MQA by head index; causal is
bottom-right; but a softmax scale > 0 only (it masks and takes row maxima of unscaled scores;
the ``pingpong`` variant refuses the rest, which the heuristic sends to Triton's); output ``[B, Sq, Hq, D]`` and ``lse``
``[B, Hq, Sq]`` in the log2 domain, with ``EMPTY_LSE`` and zeros for rows that see no key, so
the warp-specialized backward takes it as is. Rows and blocks are addressed in the 2-D views
``[B·S, H·D]``: a key block that runs into the next batch's rows is masked like one past the
end, and query rows past ``seqlen_q`` are never stored. A hidden NaN or Inf key or value
reaches no row: a consumer passes the V slot of a block it masks through ``_finite_or_zero``
before its P·V (the score select drops the keys'); the backward's consumers clean their K and V
once.

The backward takes ``lse`` and ``delta`` as the Triton kernels do (``[B, Hq, S]``, log2
domain), padded to whole query blocks, because its loader brings them by TMA. One program per
128 keys and batch·key head; each consumer keeps dK and dV of its 64 keys in registers and
walks (query head of the group, query block) steps whose Q, dO, lse and delta the loader puts
in a ring; a query block whose last row sees none of a consumer's keys is skipped by that
consumer. Each step's dQ = dS·K takes both consumers' dSᵀ, which they exchange through a pair
of shared-memory buffers (``ds_ready``/``ds_empty``); each computes its half of the step's
dQ tile and adds it into a float32 accumulator ``[B·Sq, Hq·D]`` by a TMA reduce-add, so the
programs of all key blocks sum into it (in no fixed order: dQ's last bits vary from run to
run). Rows of a step past ``seqlen_q`` belong to the next batch; their lse is padded with
``EMPTY_LSE``, so they add exact zeros. Without ``FUSE_DQ`` (the backward variant
``gluon_dkdv``: the usual dQ kernel runs first) the kernel computes dK and dV only.
Under a causal mask the longest programs run first, in head groups, as the forward's.

GPU only: Triton's interpreter does not run Gluon, so the CPU tests run the Triton twin and
compile these kernels for sm_90 (``tests/triton/test_codegen.py``); ``tests/triton`` runs it on
the GPU (``-m gpu``). Launched by :func:`ejkernel_triton._kernel_cache._compile_direct`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ejkernel_triton.kernels.flash_attention_common import (
    EMPTY_LSE,
    LOG2E,
    MASK_VALUE,
    _finite_or_zero,
    _heads,
    _program_tile,
    _tanh,
)

#: query rows per consumer warp group (a program's tile is two of them)
HALF: gl.constexpr = gl.constexpr(64)
CONSUMER_REGS: gl.constexpr = gl.constexpr(240)
LOADER_REGS: gl.constexpr = gl.constexpr(24)


@gluon.constexpr_function
def _wgmma_layout(n):
    """The accumulator layout of a consumer's (4 warps') matmuls with ``n`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _operand_layout(acc_layout):
    """Registers as the left operand (P, dS) of a matmul into ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)


@gluon.jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers in shared memory, each completing a phase at ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _ring(dtype: gl.constexpr, q_sl, kv_sl, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr):  # fmt: skip
    """The forward's shared memory: ``(smem, bars, turn)``, the two halves of Q and ``STAGES``
    K and V slots, their barriers (a slot's ``*_empty`` completes when both consumers release
    it) and the two consumers' ``turn`` barriers, fenced."""
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    q_bar = _barriers(2, 1)
    turn = _barriers(2, 1)
    k_ready = _barriers(STAGES, 1)
    v_ready = _barriers(STAGES, 1)
    k_empty = _barriers(STAGES, 2)
    v_empty = _barriers(STAGES, 2)
    fence_async_shared()
    return (q_smem, k_smem, v_smem), (q_bar, k_ready, v_ready, k_empty, v_empty), turn


@gluon.jit
def _finite_or_zero_smem(tile):
    """A K or V tile in shared memory through ``_finite_or_zero``, in place, by the 4 warps of
    a consumer; fenced, so that the tensor cores' reads issued next see it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tile.store(_finite_or_zero(tile.load(layout)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _finite_or_zero_v(v, start_n, mask_from, MASKED: gl.constexpr):
    """The V tile of the key block at ``start_n`` through ``_finite_or_zero`` where this
    consumer masks the block (as :func:`_softmax_step`): a hidden NaN or Inf value would
    reach its rows through ``0 · NaN`` in P·V. Both consumers read the slot; one that sees the
    block whole may read it before or after the other cleans it, which changes only entries
    its rows see (what a row computes from a non-finite value it sees is unspecified). The
    keys' NaN and Inf need nothing: the score select drops them."""
    if MASKED:  # noqa: SIM102 (a constexpr: no code at all when false)
        if start_n >= mask_from:
            _finite_or_zero_smem(v)


@gluon.jit
def _load_q(q_desc, q_smem, q_bar, q_row, q_col):
    """Both consumers' halves of the program's Q tile, from row ``q_row``, column ``q_col``."""
    for wg in gl.static_range(2):
        mbarrier.expect(q_bar.index(wg), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [q_row + wg * HALF, q_col], q_bar.index(wg), q_smem.index(wg)
        )


@gluon.jit
def _cache_row(table_row, live_pages, num_pages, key, PAGE_SIZE: gl.constexpr):
    """The row of a paged cache seen as ``[num_pages · page_size, Hkv · D]`` that holds the
    sequence's key ``key``: through its table row, the page id clamped to ``[0, num_pages)``,
    page 0 for a slot past the live pages (whose table entry is never read)."""
    slot = key // PAGE_SIZE
    page = gl.load(table_row + slot, mask=slot < live_pages, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1)
    return page * PAGE_SIZE + key % PAGE_SIZE


@gluon.jit
def _copy_keys(desc, dest, bar, where, key, PAGE_SIZE: gl.constexpr):
    """The K or V block of the keys from ``key`` into the ring slot ``dest``, all its copies
    completing ``bar``. ``PAGE_SIZE`` 0: one TMA copy of contiguous rows, ``where`` = (the
    first key's row, the KV head's column). Else a paged cache's: one copy a page (or one of
    the slot's rows from a longer page), ``where`` = (the KV head's column, the table row, the
    live pages, the cache's pages)."""
    if PAGE_SIZE == 0:
        row, col = where
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row + key, col], bar, dest)
    else:
        col, table_row, live_pages, num_pages = where
        COPY: gl.constexpr = desc.block_type.shape[0]
        COPIES: gl.constexpr = dest.type.shape[0] // COPY
        mbarrier.expect(bar, desc.block_type.nbytes * COPIES)
        for c in gl.static_range(COPIES):
            row = _cache_row(table_row, live_pages, num_pages, key + c * COPY, PAGE_SIZE)
            tma.async_copy_global_to_shared(desc, [row, col], bar, dest.slice(c * COPY, COPY))


@gluon.jit
def _loader(descs, smem, bars, place, n_blocks, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """The loader warp: both halves of Q, then K and V of each key block into the ring
    (:func:`_copy_keys`, contiguous rows or, with ``PAGE_SIZE``, a paged cache's pages).
    ``place``: Q's row and column, and the keys' ``where``."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = smem
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    q_row, q_col, where = place
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    _load_q(q_desc, q_smem, q_bar, q_row, q_col)
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        _copy_keys(k_desc, k_smem.index(slot), k_ready.index(slot), where, j * BLOCK_N, PAGE_SIZE)
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _copy_keys(v_desc, v_smem.index(slot), v_ready.index(slot), where, j * BLOCK_N, PAGE_SIZE)


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    start_n,
    tile_consts,
    SOFT_CAP: gl.constexpr,
    MASKED: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """One key block's online softmax of the raw scores ``s = q·kᵀ``: ``(p, alpha, m_i,
    l_i)``. The log2-domain scores are ``s · scale`` (``scale = sm_scale · log2 e``); with a
    soft cap they are ``softcap(sm_scale · s) · log2 e``, computed here, and ``scale`` is 1.
    ``tile_consts``: what the consumer's blocks share (:func:`_consumer`)."""
    mask_from, offs_m, offs_n, q_pos_offset, seqlen_k, scale, soft_cap = tile_consts
    if SOFT_CAP:
        s = _tanh(s * (scale / (soft_cap * LOG2E))) * (soft_cap * LOG2E)
        scale = 1.0
    if MASKED:  # noqa: SIM102 (a constexpr: no mask code at all when false)
        if start_n >= mask_from:
            cols = start_n + offs_n
            visible = (cols < seqlen_k)[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + q_pos_offset)
            s = gl.where(visible, s, MASK_VALUE)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = m_new * scale
    p = gl.exp2(s * scale - m_scaled[:, None])
    alpha = gl.exp2(m_i * scale - m_scaled)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _consumer(
    smem,
    bars,
    turn,
    tile,
    n_blocks,
    WG: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFT_CAP: gl.constexpr,
    EVEN_K: gl.constexpr,
):
    """Consumer ``WG`` (0 or 1): query rows ``[WG·64, WG·64 + 64)`` of the program's tile."""
    q_smem, k_smem, v_smem = smem
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    out_ptr, lse_ptr, sm_scale, soft_cap, seqlen_q, seqlen_k, num_heads, start_m, off_b, off_h = (
        tile
    )
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = _operand_layout(o_layout)
    MASKED: gl.constexpr = CAUSAL or not EVEN_K

    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    row0 = start_m * (2 * HALF) + WG * HALF
    offs_m = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    scale = sm_scale * LOG2E
    # key blocks from mask_from on are cut by the sequence end or this half's diagonal
    mask_from = seqlen_k - BLOCK_N + 1
    if CAUSAL:
        mask_from = gl.minimum(mask_from, row0 + q_pos_offset - BLOCK_N + 1)

    tile_consts = (mask_from, offs_m, offs_n, q_pos_offset, seqlen_k, scale, soft_cap)

    m_i = gl.full([HALF], MASK_VALUE, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(WG)
    mbarrier.wait(q_bar.index(WG), 0)
    # the k-th turn of consumer WG waits for parity (k + 1 + WG) & 1: consumer 0 goes first
    if n_blocks > 0:
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(turn.index(WG), (1 + WG) & 1)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, tile_consts, SOFT_CAP, MASKED, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_blocks):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            mbarrier.wait(turn.index(WG), (j + 1 + WG) & 1)
            s = warpgroup_mma(
                q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            _finite_or_zero_v(v_smem.index(prev), (j - 1) * BLOCK_N, mask_from, MASKED)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done, P·V runs on
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, alpha, m_i, l_i = _softmax_step(
                s, m_i, l_i, j * BLOCK_N, tile_consts, SOFT_CAP, MASKED, CAUSAL
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        _finite_or_zero_v(v_smem.index(last), (n_blocks - 1) * BLOCK_N, mask_from, MASKED)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)

    # the log2 domain of the scores: with a soft cap they were already scaled
    if SOFT_CAP:
        scale = 1.0
    empty = m_i <= MASK_VALUE * 0.5
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(empty, EMPTY_LSE, m_i * scale + gl.log2(l_safe))
    inv_l = gl.where(empty, 0.0, 1.0 / l_safe)
    out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
    offs_mo = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    rows = (off_b * seqlen_q + offs_mo) * num_heads + off_h
    gl.store(
        out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        out.to(dtype),
        mask=(offs_mo < seqlen_q)[:, None],
    )
    off_bh = off_b * num_heads + off_h
    gl.store(lse_ptr + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


@gluon.jit
def _head_rows(ptr, rows, heads, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, layout):
    """A TMA descriptor of ``[B, S, H, D]`` seen as ``[B·S, H·D]``: ``BLOCK`` rows of one head."""
    return tma.make_tensor_descriptor(
        ptr,
        shape=[rows, heads * HEAD_DIM],
        strides=[heads * HEAD_DIM, 1],
        block_shape=[BLOCK, HEAD_DIM],
        layout=layout,
    )


@gluon.jit
def flash_attention_fwd_pingpong_kernel(
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
    HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFT_CAP: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    EVEN_K: gl.constexpr,
    HEAD_GROUP: gl.constexpr = 0,
):
    """One program per (128-row query tile, batch·head), in the order of the Triton
    forward's ``_program_tile`` (a Triton function: Gluon calls it as its own; causal: longest
    tiles first in groups of ``HEAD_GROUP`` heads): see the module docstring."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, HALF, q_sl)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N, kv_sl)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, BLOCK_N, kv_sl)
    smem, bars, turn = _ring(dtype, q_sl, kv_sl, HEAD_DIM, BLOCK_N, STAGES)

    start_m, off_bh = _program_tile(HEAD_GROUP)
    off_b, off_h, off_hk = _heads(off_bh, num_heads, num_kv_heads)
    hi = seqlen_k
    if CAUSAL:  # the last key the tile's last row sees
        hi = gl.maximum(gl.minimum(hi, (start_m + 1) * (2 * HALF) + seqlen_k - seqlen_q), 0)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    descs = (q_desc, k_desc, v_desc)
    tile = (Out, Lse, sm_scale, soft_cap, seqlen_q, seqlen_k, num_heads, start_m, off_b, off_h)
    q_row = off_b * seqlen_q + start_m * (2 * HALF)
    place = (q_row, off_h * HEAD_DIM, (off_b * seqlen_k, off_hk * HEAD_DIM))
    gl.warp_specialize(
        [  # (constexprs inside a tuple variable would become tensors: spelled out each time)
            (_consumer, (smem, bars, turn, tile, n_blocks, 0, STAGES, CAUSAL, SOFT_CAP, EVEN_K)),
            (_consumer, (smem, bars, turn, tile, n_blocks, 1, STAGES, CAUSAL, SOFT_CAP, EVEN_K)),
            (_loader, (descs, smem, bars, place, n_blocks, STAGES, 0)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


#: 3 warp groups at 168 registers each (65536 per SM), redistributed as 240 / 240 / 24
flash_attention_fwd_pingpong_kernel.ejkernel_compile_options = {"maxnreg": 168}
