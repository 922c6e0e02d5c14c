"""Triton fused recurrent gated delta rule (Kimi Delta Attention; Gated DeltaNet for a scalar
gate): one token at a time, for decoding.

One program per (value block, sequence, head) walks the sequence's tokens in order with the
state ``S [K, BV]`` in float32 registers, the recurrence itself:
``S ← S ⊙ exp(g_t)``, ``v'_t = β_t (v_t − Sᵀ k_t)``, ``S ← S + k_t v'_tᵀ``, ``o_t = Sᵀ q_t``,
with ``q`` and ``k`` L2-normalised (``use_qk_l2norm``) and ``q`` scaled. The state is read once
and written once, so for the few tokens of a decoding step the kernel moves little more than
the state, where the chunked kernels pad to a whole chunk and launch five times.

Numerics as the chunked kernels' (:mod:`ejkernel_triton.kernels.kda_common`): gates floored
at ``-GATE_FLOOR`` (``-inf`` is a reset); a token whose key, ``β`` or gate is not finite enters
with them zeroed and its value NaN, a non-finite value entry is NaN, so the state (per value
channel) and the outputs are NaN from that token on.

Tokens are ``[B, S, H, F]`` row-major, the gate ``[B, S, H, GK]`` (``GK = K`` per channel,
``1`` per head), ``β [B, S, H]``; states ``[N, H, K, V]`` float32. Dense (``PACKED`` false)
sequence ``n`` is batch row ``n``; packed, it is tokens ``[cu[n], cu[n + 1])`` of the one row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.kda_common import finite, gate_ok
from ejkernel_triton.kernels.recurrent_fused import sequence_walk


@triton.jit
def kda_fused_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
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
    GK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
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
        b_q = tl.load(q_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta_ptr + row).to(tl.float32)
        if GK == 1:  # one decay for every key channel
            b_g = tl.zeros([BK], dtype=tl.float32) + tl.load(g_ptr + row).to(tl.float32)
        else:
            b_g = tl.load(g_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        bad = tl.sum((~gate_ok(b_g) | ~finite(b_k)).to(tl.int32), axis=0) > 0
        bad = bad | ~finite(b_beta)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_q = b_q * scale
        b_k = tl.where(bad, 0.0, b_k)
        b_beta = tl.where(bad, 0.0, b_beta)
        b_g = tl.where(bad, 0.0, b_g)
        b_g = tl.where(b_g < -GATE_FLOOR, -GATE_FLOOR, b_g)
        b_v = tl.where(finite(b_v) & ~bad, b_v, float("nan"))
        b_h = b_h * tl.exp(b_g)[:, None]
        b_vn = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h = b_h + b_k[:, None] * b_vn[None, :]
        b_h = tl.where(m_k[:, None], b_h, 0.0)  # padding rows stay 0 (a NaN value: 0 · NaN)
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o_ptr + row * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(final_ptr + state, b_h, mask=m_kv)
