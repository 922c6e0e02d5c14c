"""Flash attention backward for Hopper in Gluon: dQ, dK and dV in one kernel
(:func:`flash_attention_bwd_gluon_kernel`) of a loader warp and two consumer warp groups, as
FlashAttention-3's (Shah et al., 2024); the contract and the schedule are described in
:mod:`ejkernel_triton.kernels.flash_attention_hopper_fwd`, whose helpers it shares.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ejkernel_triton.kernels.flash_attention_common import (
    LOG2E,
    MASK_VALUE,
    _program_tile,
    _tanh,
)
from ejkernel_triton.kernels.flash_attention_hopper_fwd import (
    CONSUMER_REGS,
    HALF,
    LOADER_REGS,
    _barriers,
    _finite_or_zero_smem,
    _head_rows,
    _operand_layout,
    _wgmma_layout,
)

# -- backward -----------------------------------------------------------------------------------


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord:] += src`` (a shared-memory tile) by TMA (``cp.reduce.async.bulk``);
    ``tma.store_wait`` waits for it. Gluon 3.6's ``tma`` module has no reduce; its op builder
    has."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def _bwd_loader(descs, smem, bars, loads, steps, STAGES: gl.constexpr):
    """The loader warp: both consumers' K and V rows once, then Q and dO of each (query head,
    query block) step into the ring."""
    n_m, n_iters = steps
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, _ = descs
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, _, _ = smem
    kv_bar, q_ready, do_ready, q_empty, do_empty, _, _ = bars
    q_row, q_col, k_row, k_col, stats0, stats_len = loads
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    for wg in gl.static_range(2):
        mbarrier.expect(kv_bar.index(wg), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [k_row + wg * HALF, k_col], kv_bar.index(wg), k_smem.index(wg)
        )
        tma.async_copy_global_to_shared(
            v_desc, [k_row + wg * HALF, k_col], kv_bar.index(wg), v_smem.index(wg)
        )
    for it in range(n_iters):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        row = q_row + (it % n_m) * BLOCK_M
        col = q_col + (it // n_m) * HEAD_DIM
        stat = stats0 + (it // n_m) * stats_len + (it % n_m) * BLOCK_M
        ready = q_ready.index(slot)
        mbarrier.wait(q_empty.index(slot), phase ^ 1)
        mbarrier.expect(ready, q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col], ready, q_smem.index(slot))
        tma.async_copy_global_to_shared(lse_desc, [stat], ready, lse_smem.index(slot))
        ready = do_ready.index(slot)
        mbarrier.wait(do_empty.index(slot), phase ^ 1)
        mbarrier.expect(ready, do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, col], ready, do_smem.index(slot))
        tma.async_copy_global_to_shared(delta_desc, [stat], ready, delta_smem.index(slot))


@gluon.jit
def _put_ds(ds_smem, ds_ready, ds_empty, n_ds, ds, WG: gl.constexpr):
    """Consumer ``WG``'s half of dSᵀ (its 64 keys × the step's rows) into buffer ``n_ds % 2``
    of the pair both consumers read their dQ from."""
    buf = n_ds % 2
    mbarrier.wait(ds_empty.index(buf), ((n_ds // 2) & 1) ^ 1)
    ds_smem.index(2 * buf + WG).store(ds)
    fence_async_shared()
    gl.thread_barrier()  # the whole warp group's part is written before the arrive
    mbarrier.arrive(ds_ready.index(buf), count=1)


@gluon.jit
def _dq_issue(smem, bars, n_ds, WG: gl.constexpr):
    """Consumer ``WG``'s share of the step's dQ, issued once both halves of dSᵀ are in (its
    ``warpgroup_mma`` token): at 128 query rows a step the rows ``[WG·64, WG·64 + 64)``, at 64
    the columns ``[WG·D/2, WG·D/2 + D/2)``; ``dQ = dS·k`` over the program's 128 keys (both
    consumers' K)."""
    k_smem, ds_smem, dq_smem = smem[2], smem[6], smem[7]
    ds_ready = bars[5]
    BLOCK_M: gl.constexpr = ds_smem.type.shape[2]
    DQ_M: gl.constexpr = dq_smem.type.shape[1]
    DQ_N: gl.constexpr = dq_smem.type.shape[2]
    dq_layout: gl.constexpr = _wgmma_layout(DQ_N)
    buf = n_ds % 2
    mbarrier.wait(ds_ready.index(buf), (n_ds // 2) & 1)
    dq = gl.zeros([DQ_M, DQ_N], gl.float32, layout=dq_layout)
    for j in gl.static_range(2):  # the keys of consumer j
        ds_t = ds_smem.index(2 * buf + j)  # [keys, rows]
        k = k_smem.index(j)  # [keys, D]
        if DQ_M == BLOCK_M:  # a share of the columns
            k = k.slice(WG * DQ_N, DQ_N, dim=1)
        else:  # a share of the rows
            ds_t = ds_t.slice(WG * DQ_M, DQ_M, dim=1)
        dq = warpgroup_mma(ds_t.permute((1, 0)), k, dq, use_acc=j > 0, is_async=True)
    return dq


@gluon.jit
def _dq_add(descs, smem, bars, n_ds, dq, dq_row, dq_col, WG: gl.constexpr):
    """Frees the step's dSᵀ buffer and adds consumer ``WG``'s finished dQ share (see
    :func:`_dq_issue`) into the float32 accumulator by TMA."""
    dq_desc = descs[6]
    dq_smem = smem[7]
    ds_empty = bars[6]
    BLOCK_M: gl.constexpr = smem[6].type.shape[2]
    DQ_M: gl.constexpr = dq_smem.type.shape[1]
    DQ_N: gl.constexpr = dq_smem.type.shape[2]
    mbarrier.arrive(ds_empty.index(n_ds % 2), count=1)
    staging = dq_smem.index(WG)
    tma.store_wait(0)  # the previous step's reduce has read the staging tile
    gl.thread_barrier()
    staging.store(dq)
    fence_async_shared()
    gl.thread_barrier()
    if DQ_M == BLOCK_M:
        _tma_reduce_add(dq_desc, [dq_row, dq_col + WG * DQ_N], staging)
    else:
        _tma_reduce_add(dq_desc, [dq_row + WG * DQ_M, dq_col], staging)


@gluon.jit
def _bwd_consumer(
    descs,
    smem,
    bars,
    call,
    tile,
    loads,
    steps,
    WG: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFT_CAP: gl.constexpr,
    FUSE_DQ: gl.constexpr,
):
    """Consumer ``WG`` (0 or 1): dK and dV of keys ``[WG·64, WG·64 + 64)`` of the program's
    block, in transposed form (keys are rows): ``sᵀ = k·qᵀ``, ``pᵀ = exp2(sᵀ − lse)``,
    ``dV += pᵀ·dO``, ``dPᵀ = v·dOᵀ``, ``dSᵀ = pᵀ ∘ (dPᵀ − delta)``, ``dK += dSᵀ·q``; and its
    share of each step's dQ from both consumers' dSᵀ (:func:`_dq_issue`, :func:`_dq_add`)."""
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, _ = smem
    n_m, n_iters = steps  # query blocks per head, steps in all
    kv_bar, q_ready, do_ready, q_empty, do_empty, ds_ready, ds_empty = bars
    dk_ptr, dv_ptr, sm_scale, soft_cap, seqlen_q, seqlen_k, num_kv_heads = call
    start_n, m_start, off_b, off_hk = tile
    q_row, q_col = loads[0], loads[1]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = _operand_layout(acc_layout)
    stat_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_pos_offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    key_first = start_n * (2 * HALF)
    key0 = key_first + WG * HALF
    offs_n = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    key_in = offs_n < seqlen_k
    if SOFT_CAP:
        cap_in = sm_scale / soft_cap
        cap_out = soft_cap * LOG2E
    else:
        scale = sm_scale * LOG2E

    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=s_layout)
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    n_ds = 0  # steps with a dQ (both consumers count the same ones)
    mbarrier.wait(kv_bar.index(WG), 0)
    # the consumer's keys and values, once: a hidden NaN or Inf would reach dQ's rows through
    # 0 · NaN in dPᵀ = v·dOᵀ and dQ = dS·k (the other consumer reads this K only after the
    # first dSᵀ exchange, which follows)
    _finite_or_zero_smem(k)
    _finite_or_zero_smem(v)
    for it in range(n_iters):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        row0 = (m_start + it % n_m) * BLOCK_M
        rows = row0 + offs_m
        mbarrier.wait(q_ready.index(slot), phase)
        mbarrier.wait(do_ready.index(slot), phase)
        dq_row = q_row + (it % n_m) * BLOCK_M
        dq_col = q_col + (it // n_m) * HEAD_DIM
        seen = True  # whether the block's last row sees the first of these keys
        any_seen = True  # ... of the program's keys (then both consumers take part in dQ)
        if CAUSAL:
            seen = row0 + BLOCK_M - 1 + q_pos_offset >= key0
            any_seen = row0 + BLOCK_M - 1 + q_pos_offset >= key_first
        if seen:
            q = q_smem.index(slot)
            do = do_smem.index(slot)
            s = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            if SOFT_CAP:
                t = _tanh(s * cap_in)
                s = t * cap_out
            else:
                s = s * scale
            if CAUSAL:  # noqa: SIM102 (a constexpr: no mask code at all when false)
                if row0 + q_pos_offset < key0 + HALF - 1:
                    visible = offs_n[:, None] <= rows[None, :] + q_pos_offset
                    s = gl.where(visible, s, MASK_VALUE)
            lse = lse_smem.index(slot).load(stat_layout)
            p = gl.exp2(s - lse[None, :])
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do, dv, is_async=True)
            dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
            delta = delta_smem.index(slot).load(stat_layout)
            ds = p * (dp - delta[None, :])
            if SOFT_CAP:
                ds = ds * (1.0 - t * t)
            if key0 + HALF > seqlen_k:  # keys past the end (another batch's) give dQ nothing
                ds = gl.where(key_in[:, None], ds, 0.0)
            ds = ds.to(dtype)
            ds_op = gl.convert_layout(ds, op_layout)
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            if FUSE_DQ:
                _put_ds(ds_smem, ds_ready, ds_empty, n_ds, ds, WG)
            dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv,))
            mbarrier.arrive(do_empty.index(slot), count=1)
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
            mbarrier.arrive(q_empty.index(slot), count=1)
        else:
            mbarrier.arrive(do_empty.index(slot), count=1)
            mbarrier.arrive(q_empty.index(slot), count=1)
            if FUSE_DQ:  # noqa: SIM102 (a constexpr: no dQ code at all when false)
                if any_seen:  # the other consumer's keys are seen: this half of dSᵀ is zero
                    _put_ds(ds_smem, ds_ready, ds_empty, n_ds, s_zero.to(dtype), WG)
        if FUSE_DQ:  # noqa: SIM102 (a constexpr: no dQ code at all when false)
            if any_seen:  # (seen implies any_seen)
                dq = _dq_issue(smem, bars, n_ds, WG)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
                _dq_add(descs, smem, bars, n_ds, dq, dq_row, dq_col, WG)
                n_ds += 1
    tma.store_wait(0)

    offs_k = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    rows_k = (off_b * seqlen_k + offs_k) * num_kv_heads + off_hk
    ptrs = rows_k[:, None] * HEAD_DIM + offs_d[None, :]
    in_k = (offs_k < seqlen_k)[:, None]
    gl.store(dk_ptr + ptrs, (dk * sm_scale).to(dtype), mask=in_k)
    gl.store(dv_ptr + ptrs, dv.to(dtype), mask=in_k)


@gluon.jit
def flash_attention_bwd_gluon_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    sm_scale,
    soft_cap,
    batch,
    seqlen_q,
    seqlen_k,
    num_heads,
    num_kv_heads,
    stats_len,
    DK,
    DV,
    DQ,  # float32, zeroed: dQ / sm_scale accumulates here
    GlobalScratch,  # TMA descriptors are built here, per program (see _kernel_cache)
    HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFT_CAP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    HEAD_GROUP: gl.constexpr = 0,
    FUSE_DQ: gl.constexpr = True,
):
    """One program per (128-key block, batch·key head), in the order of ``_program_tile``
    reversed (causal: the longest programs, the first key blocks, first in groups of
    ``HEAD_GROUP`` heads): see the section's consumer."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], dtype)
    # each consumer's dQ share of a step: 64 rows of 128, or half the columns of 64 rows
    DQ_M: gl.constexpr = HALF
    DQ_N: gl.constexpr = HEAD_DIM * BLOCK_M // (2 * HALF)
    dq_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DQ_M, DQ_N], gl.float32)
    q_desc = _head_rows(Q, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M, q_sl)
    do_desc = _head_rows(DO, batch * seqlen_q, num_heads, HEAD_DIM, BLOCK_M, q_sl)
    k_desc = _head_rows(K, batch * seqlen_k, num_kv_heads, HEAD_DIM, HALF, kv_sl)
    v_desc = _head_rows(V, batch * seqlen_k, num_kv_heads, HEAD_DIM, HALF, kv_sl)
    dq_desc = tma.make_tensor_descriptor(
        DQ,
        shape=[batch * seqlen_q, num_heads * HEAD_DIM],
        strides=[num_heads * HEAD_DIM, 1],
        block_shape=[DQ_M, DQ_N],
        layout=dq_sl,
    )
    st_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    stats_size = batch * num_heads * stats_len
    lse_desc = tma.make_tensor_descriptor(
        Lse, shape=[stats_size], strides=[1], block_shape=[BLOCK_M], layout=st_sl
    )
    delta_desc = tma.make_tensor_descriptor(
        Delta, shape=[stats_size], strides=[1], block_shape=[BLOCK_M], layout=st_sl
    )
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], st_sl)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], st_sl)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], kv_sl)
    # dSᵀ: 2 buffers x 2 halves; dQ staging: a tile per consumer (a token one without FUSE_DQ)
    ds_smem = gl.allocate_shared_memory(dtype, [4 if FUSE_DQ else 1, HALF, BLOCK_M], ds_sl)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 if FUSE_DQ else 1, DQ_M, DQ_N], dq_sl)
    kv_bar = _barriers(2, 1)
    q_ready = _barriers(STAGES, 1)
    do_ready = _barriers(STAGES, 1)
    q_empty = _barriers(STAGES, 2)  # both consumers release a slot
    do_empty = _barriers(STAGES, 2)
    ds_ready = _barriers(2, 2)  # both consumers' halves
    ds_empty = _barriers(2, 2)  # both consumers' dQ read them
    fence_async_shared()

    start_n, off_bhk = _program_tile(HEAD_GROUP)
    if HEAD_GROUP != 0:  # the tile order's longest blocks are its last query blocks: reversed
        start_n = gl.num_programs(0) - 1 - start_n
    off_b = off_bhk // num_kv_heads
    off_hk = off_bhk % num_kv_heads
    group = num_heads // num_kv_heads
    m_start = 0
    if CAUSAL:  # the first query block that sees the block's first key
        m_start = gl.maximum(start_n * (2 * HALF) - (seqlen_k - seqlen_q), 0) // BLOCK_M
    n_m = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - m_start, 0)
    n_iters = group * n_m
    n_m = gl.maximum(n_m, 1)  # a divisor in the loops (which do not run when n_iters is 0)
    descs = (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc)
    smem = (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem)
    bars = (kv_bar, q_ready, do_ready, q_empty, do_empty, ds_ready, ds_empty)
    call = (DK, DV, sm_scale, soft_cap, seqlen_q, seqlen_k, num_kv_heads)
    tile = (start_n, m_start, off_b, off_hk)
    q_row = off_b * seqlen_q + m_start * BLOCK_M
    stats0 = (off_b * num_heads + off_hk * group) * stats_len + m_start * BLOCK_M
    k_row = off_b * seqlen_k + start_n * (2 * HALF)
    loads = (q_row, off_hk * group * HEAD_DIM, k_row, off_hk * HEAD_DIM, stats0, stats_len)
    steps = (n_m, n_iters)
    gl.warp_specialize(
        [  # (constexprs inside a tuple variable would become tensors: spelled out each time)
            (
                _bwd_consumer,
                (descs, smem, bars, call, tile, loads, steps, 0, STAGES, CAUSAL, SOFT_CAP, FUSE_DQ),
            ),
            (
                _bwd_consumer,
                (descs, smem, bars, call, tile, loads, steps, 1, STAGES, CAUSAL, SOFT_CAP, FUSE_DQ),
            ),
            (_bwd_loader, (descs, smem, bars, loads, steps, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


flash_attention_bwd_gluon_kernel.ejkernel_compile_options = {"maxnreg": 168}
