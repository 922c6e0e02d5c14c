"""Experiment (not used by the op): a flash-attention forward in Gluon for Hopper.

Gluon (``triton.experimental.gluon``, triton 3.6) exposes what ``tl.dot`` hides: asynchronous
wgmma with explicit waits, shared-memory layouts, cp.async groups. This kernel issues
``S_j = Q·K_jᵀ`` and ``O += P_{j-1}·V_{j-1}`` back to back and computes the softmax of
``S_j`` while the second runs (FA3's intra-warpgroup overlap); K/V arrive by cp.async in a
ring of ``STAGES`` slots, one block ahead. All eight warps load and compute (no warp
specialisation, no ping-pong between the two warpgroups yet).

Scope: bf16/f16, D 64 or 128, causal (bottom-right) or not, GQA, Sq a multiple of
``BLOCK_M``. It runs through jax-triton like the Triton kernels
(:func:`ejkernel_triton._kernel_cache._compile_gluon`). Measured in
``benchmarks/RESULTS.md`` (seventh session) with ``gluon_fwd_ab.py``.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
MASK_VALUE: gl.constexpr = gl.constexpr(-1.0e30)


@triton.constexpr_function
def _load_layout(head_dim, num_warps):
    per_row = head_dim // 8  # threads along D, 16 bytes each
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_kv(
    k_smem, v_smem, slot, k_base, v_base, start_n, seqlen_k, stride_ks, stride_vs, offs_n, offs_d
):
    rows = start_n + offs_n
    ok = (rows < seqlen_k)[:, None]
    async_copy.async_copy_global_to_shared(
        k_smem.index(slot), k_base + rows[:, None] * stride_ks + offs_d[None, :], mask=ok
    )
    async_copy.async_copy_global_to_shared(
        v_smem.index(slot), v_base + rows[:, None] * stride_vs + offs_d[None, :], mask=ok
    )
    async_copy.commit_group()


@gluon.jit
def _aligned(stride_b, stride_s, stride_h, ALIGN: gl.constexpr):
    """Strides arrive in units of ``ALIGN`` elements (a divisibility jax-triton cannot state)."""
    return stride_b * ALIGN, stride_s * ALIGN, stride_h * ALIGN


@gluon.jit
def _mask(s, start_n, diag, offs_m, offs_n, seqlen_k, q_pos_offset, CAUSAL: gl.constexpr):
    if start_n >= diag:
        cols = start_n + offs_n
        visible = (cols < seqlen_k)[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + q_pos_offset)
        s = gl.where(visible, s, MASK_VALUE)
    return s


@gluon.jit
def flash_attention_fwd_gluon(
    Q,
    K,
    V,
    sm_scale,
    seqlen_q,
    seqlen_k,
    num_heads_q,
    num_heads_k,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    Out,
    Lse,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    ALIGN: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = Q.dtype.element_ty
    stride_qb, stride_qs, stride_qh = _aligned(stride_qb, stride_qs, stride_qh, ALIGN)
    stride_kb, stride_ks, stride_kh = _aligned(stride_kb, stride_ks, stride_kh, ALIGN)
    stride_vb, stride_vs, stride_vh = _aligned(stride_vb, stride_vs, stride_vh, ALIGN)
    stride_ob, stride_os, stride_oh = _aligned(stride_ob, stride_os, stride_oh, ALIGN)

    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    off_b = off_bh // num_heads_q
    off_h = off_bh % num_heads_q
    off_hk = off_h // (num_heads_q // num_heads_k)
    q_pos_offset = seqlen_k - seqlen_q

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = _load_layout(HEAD_DIM, NUM_WARPS)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)

    offs_m_ld = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    offs_n_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
    offs_d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld_layout))
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    async_copy.async_copy_global_to_shared(
        q_smem,
        q_base + offs_m_ld[:, None] * stride_qs + offs_d_ld[None, :],
        mask=(offs_m_ld < seqlen_q)[:, None],
    )
    async_copy.commit_group()

    # key blocks: [0, hi); the last ones (from diag) need the causal mask or bounds
    hi = seqlen_k
    if CAUSAL:
        hi = gl.minimum(hi, (start_m + 1) * BLOCK_M + q_pos_offset)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    for i in gl.static_range(STAGES - 2):  # blocks 0 .. STAGES-3
        _issue_kv(
            k_smem,
            v_smem,
            i,
            k_base,
            v_base,
            i * BLOCK_N,
            hi,
            stride_ks,
            stride_vs,
            offs_n_ld,
            offs_d_ld,
        )

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    qk_scale = sm_scale * LOG2E
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    # key blocks from `diag` on are cut by the causal diagonal or the sequence end
    diag = seqlen_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        diag = gl.minimum(diag, (start_m * BLOCK_M + q_pos_offset) // BLOCK_N * BLOCK_N)

    # block 0: scores only
    async_copy.wait_group(STAGES - 3)
    gl.thread_barrier()
    fence_async_shared()
    _issue_kv(
        k_smem,
        v_smem,
        STAGES - 2,
        k_base,
        v_base,
        (STAGES - 2) * BLOCK_N,
        hi,
        stride_ks,
        stride_vs,
        offs_n_ld,
        offs_d_ld,
    )
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s = _mask(s * qk_scale, 0, diag, offs_m, offs_n, seqlen_k, q_pos_offset, CAUSAL)
    m_i = gl.max(s, axis=1)
    pf = gl.exp2(s - m_i[:, None])
    l_i = gl.sum(pf, axis=1)
    p = gl.convert_layout(pf.to(dtype), p_layout)

    for j in range(1, n_blocks):
        # every warp is past iteration j-1, so P_{j-2}·V_{j-2} is done: refill that slot
        async_copy.wait_group(STAGES - 3)
        gl.thread_barrier()
        fence_async_shared()
        _issue_kv(
            k_smem,
            v_smem,
            (j + STAGES - 2) % STAGES,
            k_base,
            v_base,
            (j + STAGES - 2) * BLOCK_N,
            hi,
            stride_ks,
            stride_vs,
            offs_n_ld,
            offs_d_ld,
        )
        s = warpgroup_mma(
            q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True
        )
        acc = warpgroup_mma(p, v_smem.index((j - 1) % STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done, P·V may run on
        s = _mask(s * qk_scale, j * BLOCK_N, diag, offs_m, offs_n, seqlen_k, q_pos_offset, CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        pf = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(pf, axis=1)
        m_i = m_new
        p = gl.convert_layout(pf.to(dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = warpgroup_mma(p, v_smem.index((n_blocks - 1) % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    lse = m_i + gl.log2(l_safe)
    offs_mo = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        Out
        + off_b * stride_ob
        + off_h * stride_oh
        + offs_mo[:, None] * stride_os
        + offs_do[None, :]
    )
    gl.store(o_ptrs, out.to(dtype), mask=(offs_mo < seqlen_q)[:, None])
    gl.store(Lse + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
