"""Probe: the dK/dV kernel through TMA and Triton's Hopper autoWS."""

import triton
import triton.language as tl

from ejkernel_triton._kernel_cache import compile_directly


@compile_directly
@triton.jit
def bwd_dkdv_ws(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    sm_scale,
    B,
    Sq,
    Sk,
    H,
    HK,
    DK,
    DV,
    GlobalScratch,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    q_desc = tl.make_tensor_descriptor(
        Q, shape=[B * Sq, H * HEAD_DIM], strides=[H * HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM]
    )
    do_desc = tl.make_tensor_descriptor(
        DO, shape=[B * Sq, H * HEAD_DIM], strides=[H * HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM]
    )
    k_desc = tl.make_tensor_descriptor(
        K, shape=[B * Sk, H * HEAD_DIM], strides=[H * HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM]
    )
    v_desc = tl.make_tensor_descriptor(
        V, shape=[B * Sk, H * HEAD_DIM], strides=[H * HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM]
    )
    k = k_desc.load([off_b * Sk + start_n * BLOCK_N, off_h * HEAD_DIM])
    v = v_desc.load([off_b * Sk + start_n * BLOCK_N, off_h * HEAD_DIM])
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    lo = 0
    if CAUSAL:
        lo = start_n * BLOCK_N // BLOCK_M * BLOCK_M
    for start_m in tl.range(lo, Sq, BLOCK_M, warp_specialize=True):
        q = q_desc.load([off_b * Sq + start_m, off_h * HEAD_DIM])
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse = tl.load(LSE + off_bh * Sq + offs_m)
        qkT = tl.dot(k, tl.trans(q))
        pT = tl.exp2(qkT * qk_scale - lse[None, :])
        if CAUSAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = do_desc.load([off_b * Sq + start_m, off_h * HEAD_DIM])
        dv = tl.dot(pT.to(do.dtype), do, dv)
        delta = tl.load(DELTA + off_bh * Sq + offs_m)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    dk = dk * sm_scale
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (off_b * Sk + offs_n[:, None]) * (H * HEAD_DIM) + off_h * HEAD_DIM + offs_d[None, :]
    tl.store(DK + rows, dk.to(DK.dtype.element_ty))
    tl.store(DV + rows, dv.to(DV.dtype.element_ty))
