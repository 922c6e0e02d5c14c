"""Triton Mamba-1 selective scan, forward and backward: the recurrence itself, token by token
(Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023, Alg. 2;
the semantics in :mod:`ejkernel.specs.state_space_v1`).

Kernel signatures follow jax-triton's order: inputs (arrays, then scalars), outputs, constexprs.
Each program owns one batch row and a block of ``BI`` channels (grid ``(cdiv(I, BI), B)``; the
scalar ``NI`` is I) and walks the tokens in order, its state ``h [BI, N]`` in float32 registers
(``BN``: N rounded up to a power of two). Per token, in float32:

- ``Δ = dt + dt_bias`` (``HAS_BIAS``), ``softplus(Δ)`` (``SOFTPLUS``), as
  :func:`ejkernel_triton.ops.state_space_gla.delta`;
- ``dA = exp(max(Δ A, MIN_LOG_DECAY))`` with ``A`` as :func:`~ejkernel.specs.state_space_v1.
  decay_rate` gives it (``-inf`` as -1e30: a reset where ``Δ > 0``, the state passed where
  ``Δ = 0``) and the floor of :func:`~ejkernel_triton.ops.state_space_gla.log_decay` (the constexpr
  ``MIN_LOG_DECAY``, gla's);
- ``h = dA ⊙ h + (Δ x) Bᵀ``, ``y = h C + D x``, ``out = y ⊙ silu(z)`` (``HAS_GATE``).

The per-token loads (``x``, ``dt``, ``z`` of the block; ``B``, ``C`` of the row) do not
depend on ``h``, so the loop's software pipelining (``num_stages``) can issue them early.

- :func:`ssm_scan_fwd_kernel`: the output, the final state and (``STORE_STATES``) the state
  at every ``CT``-token checkpoint, ``[B, NT, I, N]`` float32 (``NT = cdiv(S, CT)``).
- :func:`ssm_scan_bwd_kernel` walks the checkpoint chunks from the last: it recomputes the
  chunk's states from its checkpoint into a scratch buffer of its own in global memory
  (``[CT + 1, BI, BN]`` float32 per program, small enough to stay in L2), then the chunk's
  tokens backwards, carrying the state gradient ``dh`` from the final state's cotangent. Per
  token, with ``dy = dout ⊙ silu(z)``: ``dz``, ``dh += dy Cᵀ``, the row's ``dC = dyᵀ h_t`` and
  ``dB = (Δ x)ᵀ dh`` (partial sums over the block's channels), ``d(Δx) = dh B``,
  ``q = dh ⊙ h_{t-1} ⊙ dA`` (zero where the floor holds), ``dΔ = Σ_n A q + x d(Δx)``,
  ``dx = Δ d(Δx) + D dy``, the running sums ``dA += Δ q`` and ``dD += dy x``; then
  ``dh ← dh ⊙ dA``. What is left of ``dh`` is the initial state's gradient. ``dΔ`` goes
  through the bias and softplus in JAX.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _delta(b_dt, b_bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """``Δ`` from ``dt`` (float32): plus the bias, then softplus, as asked."""
    if HAS_BIAS:
        b_dt = b_dt + b_bias
    if SOFTPLUS:
        b_dt = tl.maximum(b_dt, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_dt)))
    return b_dt


@triton.jit
def channel_block(
    a_ptr,
    d_ptr,
    bias_ptr,
    i_blk,
    NI,
    N: tl.constexpr,
    BN: tl.constexpr,
    BI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Channel block ``i_blk``'s offsets and masks over ``I`` and ``N`` (and over ``[BI,
    BN]``), its ``A`` [BI, BN], ``D`` and ``dt_bias`` [BI] (``D`` again without a bias)."""
    o_i = i_blk * BI + tl.arange(0, BI)
    o_n = tl.arange(0, BN)
    m_i, m_n = o_i < NI, o_n < N
    m_in = m_i[:, None] & m_n[None, :]
    o_in = o_i[:, None] * N + o_n[None, :]
    b_a = tl.load(a_ptr + o_in, mask=m_in, other=0.0)
    b_skip = tl.load(d_ptr + o_i, mask=m_i, other=0.0)
    b_bias = tl.load(bias_ptr + o_i, mask=m_i, other=0.0) if HAS_BIAS else b_skip
    return o_i, o_n, m_i, m_n, m_in, o_in, b_a, b_skip, b_bias


@triton.jit
def ssm_scan_fwd_kernel(
    x_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    a_ptr,
    d_ptr,
    bias_ptr,
    init_ptr,
    S,
    NI,
    NT,
    o_ptr,
    final_ptr,
    hs_ptr,
    N: tl.constexpr,
    BN: tl.constexpr,
    BI: tl.constexpr,
    CT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    STORE_STATES: tl.constexpr,
    MIN_LOG_DECAY: tl.constexpr,
):
    """Grid ``(cdiv(I, BI), B)``: ``out`` [B, S, I] (``x``'s dtype) of one (channel block,
    batch row), its final state [B, I, N] (float32; ``init_ptr`` the initial one, likewise)
    and, when ``STORE_STATES``, the checkpoints ``hs`` [B, NT, I, N] (float32: ``hs[:, c]`` the
    state before token ``c · CT``). ``A`` [I, N], ``D`` and ``dt_bias`` [I] float32; ``z``
    read only when ``HAS_GATE``, ``dt_bias`` only when ``HAS_BIAS``."""
    i_blk, i_b = tl.program_id(0), tl.program_id(1)
    o_i, o_n, m_i, m_n, m_in, o_in, b_a, b_skip, b_bias = channel_block(
        a_ptr, d_ptr, bias_ptr, i_blk, NI, N, BN, BI, HAS_BIAS
    )
    state = i_b.to(tl.int64) * NI * N
    b_h = tl.load(init_ptr + state + o_in, mask=m_in, other=0.0)
    p_hs = hs_ptr + i_b.to(tl.int64) * NT * NI * N + o_in
    row = i_b.to(tl.int64) * S  # token t of this batch row: row + t
    for i_c in range(NT):
        if STORE_STATES:
            tl.store(p_hs + i_c * NI * N, b_h, mask=m_in)
        for t in range(i_c * CT, tl.minimum(i_c * CT + CT, S)):
            tok = row + t
            p_ti = tok * NI + o_i
            b_x = tl.load(x_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_dt = tl.load(dt_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_b = tl.load(b_ptr + tok * N + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_c = tl.load(c_ptr + tok * N + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_d = _delta(b_dt, b_bias, HAS_BIAS, SOFTPLUS)
            b_da = tl.exp(tl.maximum(b_d[:, None] * b_a, MIN_LOG_DECAY))
            b_h = b_da * b_h + (b_d * b_x)[:, None] * b_b[None, :]
            b_y = tl.sum(b_h * b_c[None, :], axis=1) + b_skip * b_x
            if HAS_GATE:
                b_z = tl.load(z_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
                b_y = b_y * b_z * tl.sigmoid(b_z)
            tl.store(o_ptr + p_ti, b_y.to(o_ptr.dtype.element_ty), mask=m_i)
    tl.store(final_ptr + state + o_in, b_h, mask=m_in)


@triton.jit
def ssm_scan_bwd_kernel(
    x_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    a_ptr,
    d_ptr,
    bias_ptr,
    hs_ptr,
    do_ptr,
    dfinal_ptr,
    S,
    NI,
    NT,
    dx_ptr,
    dz_ptr,
    ddelta_ptr,
    db_ptr,
    dc_ptr,
    da_ptr,
    dd_ptr,
    dinit_ptr,
    scratch_ptr,
    N: tl.constexpr,
    BN: tl.constexpr,
    BI: tl.constexpr,
    CT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    MIN_LOG_DECAY: tl.constexpr,
):
    """Grid ``(cdiv(I, BI), B)``, one (channel block, batch row): ``dx`` [B, S, I] (its
    dtype), ``dz`` [B, S, I] (the gate's; written only when ``HAS_GATE``), ``dΔ`` [B, S, I]
    float32, the block's shares of ``dB`` and ``dC`` [B, S, NB, N] float32 (``NB`` the
    channel blocks: the caller sums them), the row's ``dA`` [B, I, N] (of ``A`` as the kernels
    read it) and ``dD`` [B, I] float32 (the caller sums the rows), the initial state's
    gradient [B, I, N] float32 (``dfinal_ptr`` the final state's cotangent, likewise), and
    ``scratch`` [B, NB, CT + 1, BI, BN] float32 (slot k of a chunk: the state before its
    token k). ``hs`` are the forward's checkpoints, ``do`` the output's cotangent."""
    i_blk, i_b = tl.program_id(0), tl.program_id(1)
    nb = tl.num_programs(0)
    o_i, o_n, m_i, m_n, m_in, o_in, b_a, b_skip, b_bias = channel_block(
        a_ptr, d_ptr, bias_ptr, i_blk, NI, N, BN, BI, HAS_BIAS
    )
    state = i_b.to(tl.int64) * NI * N
    b_dh = tl.load(dfinal_ptr + state + o_in, mask=m_in, other=0.0)
    b_dacc = tl.zeros([BI, BN], dtype=tl.float32)
    b_dskip = tl.zeros([BI], dtype=tl.float32)
    p_hs = hs_ptr + i_b.to(tl.int64) * NT * NI * N + o_in
    # the scratch is the program's own: full tiles, no mask
    o_slot = tl.arange(0, BI)[:, None] * BN + o_n[None, :]
    p_scr = scratch_ptr + (i_b.to(tl.int64) * nb + i_blk) * (CT + 1) * BI * BN + o_slot
    row = i_b.to(tl.int64) * S
    for j in range(NT):
        i_c = NT - 1 - j
        t0 = i_c * CT
        t1 = tl.minimum(t0 + CT, S)
        b_h = tl.load(p_hs + i_c * NI * N, mask=m_in, other=0.0)
        tl.debug_barrier()  # the last chunk's reads of the scratch are done
        tl.store(p_scr, b_h)
        for t in range(t0, t1):
            tok = row + t
            p_ti = tok * NI + o_i
            b_x = tl.load(x_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_dt = tl.load(dt_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_b = tl.load(b_ptr + tok * N + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_d = _delta(b_dt, b_bias, HAS_BIAS, SOFTPLUS)
            b_da = tl.exp(tl.maximum(b_d[:, None] * b_a, MIN_LOG_DECAY))
            b_h = b_da * b_h + (b_d * b_x)[:, None] * b_b[None, :]
            tl.store(p_scr + (t - t0 + 1) * BI * BN, b_h)
        tl.debug_barrier()  # the chunk's states are in the scratch
        for k in range(0, t1 - t0):
            t = t1 - 1 - k
            tok = row + t
            p_ti = tok * NI + o_i
            b_x = tl.load(x_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_dt = tl.load(dt_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_do = tl.load(do_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
            b_b = tl.load(b_ptr + tok * N + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_c = tl.load(c_ptr + tok * N + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_ht = tl.load(p_scr + (t - t0 + 1) * BI * BN)
            b_hp = tl.load(p_scr + (t - t0) * BI * BN)
            b_d = _delta(b_dt, b_bias, HAS_BIAS, SOFTPLUS)
            b_lg = b_d[:, None] * b_a
            b_da = tl.exp(tl.maximum(b_lg, MIN_LOG_DECAY))
            b_dy = b_do
            if HAS_GATE:
                b_z = tl.load(z_ptr + p_ti, mask=m_i, other=0.0).to(tl.float32)
                b_sig = tl.sigmoid(b_z)
                b_y = tl.sum(b_ht * b_c[None, :], axis=1) + b_skip * b_x
                b_dz = b_do * b_y * b_sig * (1.0 + b_z * (1.0 - b_sig))
                tl.store(dz_ptr + p_ti, b_dz.to(dz_ptr.dtype.element_ty), mask=m_i)
                b_dy = b_do * b_z * b_sig
            b_dskip += b_dy * b_x
            tl.store(
                dc_ptr + (tok * nb + i_blk) * N + o_n,
                tl.sum(b_dy[:, None] * b_ht, axis=0),
                mask=m_n,
            )
            b_dh += b_dy[:, None] * b_c[None, :]
            b_u = b_d * b_x
            tl.store(
                db_ptr + (tok * nb + i_blk) * N + o_n, tl.sum(b_u[:, None] * b_dh, axis=0), mask=m_n
            )
            b_du = tl.sum(b_dh * b_b[None, :], axis=1)
            # the floor's gradient is 0 (JAX's maximum below it)
            b_q = tl.where(b_lg > MIN_LOG_DECAY, b_dh * b_hp * b_da, 0.0)
            b_dacc += b_d[:, None] * b_q
            b_ddelta = tl.sum(b_a * b_q, axis=1) + b_x * b_du
            tl.store(ddelta_ptr + p_ti, b_ddelta, mask=m_i)
            b_dx = b_d * b_du + b_skip * b_dy
            tl.store(dx_ptr + p_ti, b_dx.to(dx_ptr.dtype.element_ty), mask=m_i)
            b_dh = b_dh * b_da
    tl.store(da_ptr + state + o_in, b_dacc, mask=m_in)
    tl.store(dd_ptr + i_b.to(tl.int64) * NI + o_i, b_dskip, mask=m_i)
    tl.store(dinit_ptr + state + o_in, b_dh, mask=m_in)
