"""Triton mean pooling: :func:`mean_pooling_fwd_kernel` (float32 sums of each sequence's tokens,
in ``SPLIT`` parts) and :func:`mean_pooling_bwd_kernel` (each token's share of its sequence's
output gradient).

Tokens are rows of ``x [T, D]``; sequence ``n`` is rows ``[offsets[n], offsets[n + 1])``
(a dense ``[B, S, D]`` is ``B`` sequences of ``S`` rows). The launch wrapper is
:mod:`ejkernel_triton.ops.mean_pooling`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mean_pooling_fwd_kernel(
    X,
    Offsets,
    dim,
    Partial,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program: ``BLOCK_D`` columns of one part of one sequence. Grid ``(N, ⌈D/BLOCK_D⌉,
    SPLIT)``.

    The sequence's rows are cut into ``SPLIT`` consecutive parts of whole ``BLOCK_T``-row
    tiles; each program adds its part's rows in float32 and stores the column sums to
    ``Partial [N, SPLIT, D]`` (an empty part stores zeros). A sequence whose end lies before
    its start has no rows.
    """
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    part = tl.program_id(2)
    start = tl.load(Offsets + seq)
    end = tl.maximum(tl.load(Offsets + seq + 1), start)
    chunk = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_T) * BLOCK_T
    lo = start + part * chunk
    hi = tl.minimum(lo + chunk, end)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for t in range(lo, hi, BLOCK_T):
        rows = t + tl.arange(0, BLOCK_T)
        ptrs = X + rows[:, None].to(tl.int64) * dim + cols[None, :]
        x = tl.load(ptrs, mask=(rows[:, None] < hi) & (cols[None, :] < dim), other=0.0)
        acc += x.to(tl.float32)
    out = Partial + (seq * SPLIT + part).to(tl.int64) * dim + cols
    tl.store(out, tl.sum(acc, axis=0), mask=cols < dim)


@triton.jit
def mean_pooling_bwd_kernel(
    DOut,
    Seq,
    InvLength,
    num_tokens,
    dim,
    DX,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: ``BLOCK_T`` tokens × ``BLOCK_D`` columns of ``dX [T, D]``. Grid
    ``(⌈T/BLOCK_T⌉, ⌈D/BLOCK_D⌉)``.

    Token ``t`` of sequence ``Seq[t]`` gets ``dOut[Seq[t]] · InvLength[Seq[t]]``; a token of
    no sequence (``Seq[t] < 0``) gets zeros.
    """
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    seq = tl.load(Seq + rows, mask=rows < num_tokens, other=-1)
    inside = seq >= 0
    safe = tl.where(inside, seq, 0)
    inv = tl.load(InvLength + safe, mask=inside, other=0.0)
    col_ok = cols[None, :] < dim
    g = tl.load(
        DOut + safe[:, None].to(tl.int64) * dim + cols[None, :],
        mask=inside[:, None] & col_ok,
        other=0.0,
    )
    dx = g.to(tl.float32) * inv[:, None]
    ptrs = DX + rows[:, None].to(tl.int64) * dim + cols[None, :]
    tl.store(ptrs, dx.to(DX.dtype.element_ty), mask=(rows[:, None] < num_tokens) & col_ok)
