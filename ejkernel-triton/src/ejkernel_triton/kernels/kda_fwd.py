"""Triton chunked gated delta rule, forward (Kimi Delta Attention; Gated DeltaNet for a scalar
gate), in the WY/UT form (Yang et al., NeurIPS 2024, Sec. 3; Yang, Kautz, Hatamizadeh, ICLR
2025, Sec. 3.3).

Kernel signatures follow jax-triton's order: inputs (arrays, then scalars), outputs, constexprs.
The kernels read the chunk layout of :mod:`ejkernel_triton.ops.gla_layout`: tokens
``[B, T, H, F]`` with ``T = NT · C`` (packed sequences start on chunk boundaries, padding slots
hold zeros: ``β = 0`` and ``g = 0`` pass the state through), one int32 flag word per chunk
(``sid << 2 | last << 1 | first``). A gate is ``[B, T, H, GK]``: ``GK = K`` decays each key
channel, ``GK = 1`` one decay per head.

- Per chunk, with the whole chunk (``C`` tokens, all of K and V) in one program: the L2 norm
  of q and k (``use_qk_l2norm``), the query scale, the float32 cumulative log gate ``G``
  inside the chunk (gates floored at ``-GATE_FLOOR``, whose exp is 0 in float32: −inf is a
  reset and the sums stay finite), the relative decays ``exp(G_t − G_j)`` for ``j ≤ t`` only
  (never a growth), and from them ``P_tj = Σ_κ q_tκ k_jκ exp(G_tκ − G_jκ)`` (``j ≤ t``),
  ``A_tj = β_t Σ_κ k_tκ k_jκ exp(G_tκ − G_jκ)`` (``j < t``), ``T = (I + A)⁻¹`` by forward
  substitution, ``W = T diag(β) (K ⊙ exp(G))`` and ``U = T diag(β) V``, ``q ⊙ exp(G)``,
  ``k ⊙ exp(G_C − G)`` and the chunk's decay ``exp(G_C)`` (:func:`chunk_factors`). A per-head
  gate does all of it in :func:`kda_fwd_prep_kernel`. A per-channel gate's products take
  most of the work (each channel decays on its own, so the diagonal blocks go entry by
  entry): :func:`kda_fwd_norm_kernel` writes the normalised ``q``, ``k`` and ``G``,
  :func:`kda_fwd_intra_kernel` computes ``P`` and ``K Kᵀ`` in ``[SUB, SUB]`` tiles, one
  program per block of ``SUB`` rows, and :func:`kda_fwd_wy_kernel` the rest.
- :func:`kda_fwd_h_kernel` walks the chunks of one (V block, batch row, head) in order with
  the float32 state ``S [K, BV]``: ``V' = U − W S``,
  ``S ← diag(exp(G_C)) S + (k ⊙ exp(G_C − G))ᵀ V'``; it restarts from the initial state where
  a sequence begins, writes each chunk's starting state and ``V'``, and each sequence's final
  state. Only this walk is sequential.
- :func:`kda_fwd_o_kernel`, one program per (chunk, V block, batch row, head), the outputs
  ``o = (q ⊙ exp(G)) S + P V'``.

The chunk algebra the forward and backward kernels share is
:mod:`ejkernel_triton.kernels.kda_common`.

Non-finite inputs stay in their causal future (as :mod:`ejkernel_xla.ops._chunk_numerics`
has it): a token whose key, ``β`` or gate is not finite enters the chunk algebra with them and
its value zeroed, a non-finite value entry alone is zeroed, and the rows of ``U`` from the
first such token on are NaN (per value channel), so the state turns NaN there; the output
kernel keeps NaN rows of ``V'`` out of ``P V'``'s earlier rows and sets the outputs from the
first NaN row on to NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.channel_products import (
    DIAGONAL_PRODUCT_SPAN,
    DIAGONAL_PRODUCT_SPAN_F16,
)
from ejkernel_triton.kernels.kda_common import (
    SUB,
    block_inverse,
    chunk_flags,
    chunk_inputs,
    chunk_tiles,
    decayed_products,
    finite,
    l2_normalise,
    merge_block_inverses,
    unit_lower_inverse,
    walk_tiles,
)


@triton.jit
def normalised_chunk(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    scale,
    rows,
    p_k,
    m_k,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
):
    """One chunk's float32 ``q`` (L2-normalised with ``L2NORM``, times the scale), ``k``
    (likewise normalised), ``β``, cumulative log gate ``G`` and ``bad`` tokens, read with
    :func:`chunk_inputs`' numerics."""
    b_q, b_k, b_beta, b_g, bad, _ = chunk_inputs(
        q_ptr, k_ptr, beta_ptr, g_ptr, rows, p_k, m_k, GK, GATE_FLOOR
    )
    if L2NORM:
        b_q, _ = l2_normalise(b_q)
        b_k, _ = l2_normalise(b_k)
    return b_q * scale, b_k, b_beta, tl.cumsum(b_g, axis=0), bad


@triton.jit
def kda_fwd_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    scale,
    NT,
    H,
    qg_ptr,
    kg_ptr,
    w_ptr,
    u_ptr,
    p_ptr,
    decay_ptr,
    t_ptr,
    kk_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
    STORE_FACTORS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NARROW: tl.constexpr,
):
    """Grid ``(NT, B·H)``, a per-head gate's (``GK = 1``): one chunk's ``P`` [B, T, H, C]
    (float32) and, through :func:`chunk_factors`, the rest; with ``STORE_FACTORS`` (for the
    backward) also the decayed ``K Kᵀ`` [B, T, H, C] (float32). ``NARROW``: the products
    take the input dtype's operands (:func:`chunk_factors`), ``P`` and ``K Kᵀ`` too."""
    tl.static_assert(GK == 1, "a per-channel gate takes the norm, intra and WY kernels")
    o_c, o_k, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    b_q, b_k, b_beta, b_gc, bad = normalised_chunk(
        q_ptr, k_ptr, beta_ptr, g_ptr, scale, rows, p_k, m_k, GK, L2NORM, GATE_FLOOR
    )
    if NARROW:
        dt = qg_ptr.dtype.element_ty
        b_p, b_kk = decayed_products(b_q.to(dt), b_k.to(dt), b_gc, o_c, DOT_PRECISION)
    else:
        b_p, b_kk = decayed_products(b_q, b_k, b_gc, o_c, DOT_PRECISION)
    tl.store(p_ptr + rows[:, None] * C + o_c[None, :], b_p)
    if STORE_FACTORS:
        tl.store(kk_ptr + rows[:, None] * C + o_c[None, :], b_kk)
    chunk_factors(
        b_q, b_k, b_beta, b_gc, bad, b_kk, None, v_ptr, rows, p_k, slot, o_c, o_k, m_k,
        qg_ptr, kg_ptr, w_ptr, u_ptr, decay_ptr, t_ptr,
        K, V, C, BV, GK, STORE_FACTORS, DOT_PRECISION, NARROW,
    )  # fmt: skip


@triton.jit
def kda_fwd_norm_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    scale,
    NT,
    H,
    qn_ptr,
    kn_ptr,
    gc_ptr,
    bn_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
):
    """Grid ``(NT, B·H)``, a per-channel gate's: one chunk's ``q̂`` (L2-normalised with
    ``use_qk_l2norm``, times the scale) and ``k̂`` in their outputs' dtype, the float32
    cumulative log gate ``G`` [B, T, H, K] and ``β`` [B, T, H], read with
    :func:`chunk_inputs`' numerics (a token whose key, ``β`` or gate is not finite enters with
    them zeroed, and its ``β`` is written NaN: the mark :func:`normalised_inputs` reads), for
    :func:`kda_fwd_intra_kernel` and :func:`kda_fwd_wy_kernel`."""
    _, _, m_k, rows, p_k, _ = chunk_tiles(H, NT, K, C, BK)
    b_q, b_k, b_beta, b_gc, bad = normalised_chunk(
        q_ptr, k_ptr, beta_ptr, g_ptr, scale, rows, p_k, m_k, K, L2NORM, GATE_FLOOR
    )
    tl.store(qn_ptr + p_k, b_q.to(qn_ptr.dtype.element_ty), mask=m_k[None, :])
    tl.store(kn_ptr + p_k, b_k.to(kn_ptr.dtype.element_ty), mask=m_k[None, :])
    tl.store(gc_ptr + p_k, b_gc, mask=m_k[None, :])
    tl.store(bn_ptr + rows, tl.where(bad, float("nan"), b_beta))


@triton.jit
def kda_fwd_intra_kernel(
    qn_ptr,
    kn_ptr,
    gc_ptr,
    bn_ptr,
    NT,
    H,
    p_ptr,
    kk_ptr,
    tdiag_ptr,
    K: tl.constexpr,
    C: tl.constexpr,
    BKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NARROW: tl.constexpr,
):
    """Grid ``(NT · C / SUB, B·H)``: the ``SUB`` rows of row block ``i`` of one chunk's ``P``
    and decayed ``K Kᵀ`` [B, T, H, C] (float32; zero above the diagonal block), tile by tile
    (column block ``j``), from :func:`kda_fwd_norm_kernel`'s ``q̂``, ``k̂``, ``G``, over the
    key channels in blocks of ``BKS``. ``NARROW``: the products take operands in ``q̂``'s
    dtype (16-bit: the norm kernel then writes ``q̂`` and ``k̂`` in the inputs' dtype).

    The decays factor through the row block's first row ``ρ``:
    ``exp(G_t − G_ρ) · exp(G_ρ − G_s)``, both at most 1 for a decay below the diagonal block.
    On the diagonal block they are factored the same way where a block of key channels decays
    by at most :data:`~ejkernel_triton.kernels.gla_fwd.DIAGONAL_PRODUCT_SPAN` across it (the
    entries above the diagonal then selected away), and otherwise taken entry by entry, one
    column ``s`` per step: ``Σ_κ a_tκ k_sκ exp(G_tκ − G_sκ)``. The program also inverts its
    block of ``I + A`` (``A_tj = β_t (K Kᵀ)_tj``, ``j < t``) into ``tdiag`` [B, T, H, C]
    (float32; only the diagonal blocks are written), for :func:`kda_fwd_wy_kernel`."""
    NC: tl.constexpr = C // SUB
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_n, i_i = i_c // NC, i_c % NC
    i_b, i_h = i_bh // H, i_bh % H
    o_s = tl.arange(0, SUB)
    first = i_b.to(tl.int64) * NT * C * H + i_h + i_n * C * H  # the chunk's first row
    rows_i = first + (i_i * SUB + o_s) * H
    ref = first + i_i * SUB * H
    p_row = rows_i[:, None] * C + o_s[None, :]
    dt = qn_ptr.dtype.element_ty
    for i_j in range(0, i_i):  # the blocks below the diagonal
        rows_j = first + (i_j * SUB + o_s) * H
        b_p = tl.zeros([SUB, SUB], dtype=tl.float32)
        b_kk = tl.zeros([SUB, SUB], dtype=tl.float32)
        for k0 in range(0, K, BKS):
            o_k = k0 + tl.arange(0, BKS)
            m_k = (o_k < K)[None, :]
            p_i = rows_i[:, None] * K + o_k[None, :]
            p_j = rows_j[:, None] * K + o_k[None, :]
            b_gr = tl.load(gc_ptr + ref * K + o_k, mask=o_k < K, other=0.0)[None, :]
            b_in = tl.exp(tl.load(gc_ptr + p_i, mask=m_k, other=0.0) - b_gr)
            b_out = tl.exp(b_gr - tl.load(gc_ptr + p_j, mask=m_k, other=0.0))
            b_kb = tl.load(kn_ptr + p_j, mask=m_k, other=0.0) * b_out
            b_qi = tl.load(qn_ptr + p_i, mask=m_k, other=0.0) * b_in
            b_ki = tl.load(kn_ptr + p_i, mask=m_k, other=0.0) * b_in
            if NARROW:
                b_kb, b_qi, b_ki = b_kb.to(dt), b_qi.to(dt), b_ki.to(dt)
            b_p += tl.dot(b_qi, tl.trans(b_kb), input_precision=DOT_PRECISION)
            b_kk += tl.dot(b_ki, tl.trans(b_kb), input_precision=DOT_PRECISION)
        tl.store(p_ptr + p_row + i_j * SUB, b_p)
        tl.store(kk_ptr + p_row + i_j * SUB, b_kk)
    for i_j in range(i_i + 1, NC):  # above it: zeros
        tl.store(p_ptr + p_row + i_j * SUB, tl.zeros([SUB, SUB], dtype=tl.float32))
        tl.store(kk_ptr + p_row + i_j * SUB, tl.zeros([SUB, SUB], dtype=tl.float32))
    # the diagonal block: through its first row where the channels' decay span allows it
    # (see gla_fwd.DIAGONAL_PRODUCT_SPAN), entry by entry otherwise
    b_p = tl.zeros([SUB, SUB], dtype=tl.float32)
    b_kk = tl.zeros([SUB, SUB], dtype=tl.float32)
    for k0 in range(0, K, BKS):
        o_k = k0 + tl.arange(0, BKS)
        m_k = (o_k < K)[None, :]
        p_i = rows_i[:, None] * K + o_k[None, :]
        b_qi = tl.load(qn_ptr + p_i, mask=m_k, other=0.0)
        b_ki = tl.load(kn_ptr + p_i, mask=m_k, other=0.0)
        b_gi = tl.load(gc_ptr + p_i, mask=m_k, other=0.0)
        b_gr = tl.load(gc_ptr + ref * K + o_k, mask=o_k < K, other=0.0)[None, :]
        span = tl.max(b_gr - b_gi)
        limit: tl.constexpr = (
            DIAGONAL_PRODUCT_SPAN_F16 if NARROW and dt == tl.float16 else DIAGONAL_PRODUCT_SPAN
        )
        if span <= limit:
            b_in = tl.exp(b_gi - b_gr)
            b_kb = b_ki * tl.exp(b_gr - b_gi)
            b_qa = b_qi * b_in
            b_ka = b_ki * b_in
            if NARROW:
                b_kb, b_qa, b_ka = b_kb.to(dt), b_qa.to(dt), b_ka.to(dt)
            b_p += tl.dot(b_qa, tl.trans(b_kb), input_precision=DOT_PRECISION)
            b_kk += tl.dot(b_ka, tl.trans(b_kb), input_precision=DOT_PRECISION)
        else:
            for s in range(0, SUB):
                p_s = (first + (i_i * SUB + s) * H) * K + o_k
                b_ks = tl.load(kn_ptr + p_s, mask=o_k < K, other=0.0)[None, :]
                b_gs = tl.load(gc_ptr + p_s, mask=o_k < K, other=0.0)[None, :]
                seen = (o_s >= s)[:, None]
                b_ke = b_ks * tl.exp(tl.where(seen, b_gi - b_gs, float("-inf")))
                col = (o_s == s)[None, :]
                b_p = tl.where(col, b_p + tl.sum(b_qi * b_ke, axis=1)[:, None], b_p)
                b_kk = tl.where(col, b_kk + tl.sum(b_ki * b_ke, axis=1)[:, None], b_kk)
    # selected: the entries above the diagonal (a NaN key's among them) are zeros
    lower = o_s[:, None] >= o_s[None, :]
    b_p = tl.where(lower, b_p, 0.0)
    b_kk = tl.where(lower, b_kk, 0.0)
    tl.store(p_ptr + p_row + i_i * SUB, b_p)
    tl.store(kk_ptr + p_row + i_i * SUB, b_kk)
    b_beta = tl.load(bn_ptr + rows_i)
    b_beta = tl.where(b_beta == b_beta, b_beta, 0.0)  # NaN: a token that enters zeroed
    b_a = tl.where(o_s[:, None] > o_s[None, :], b_beta[:, None] * b_kk, 0.0)
    tl.store(tdiag_ptr + p_row + i_i * SUB, block_inverse(b_a, o_s))


@triton.jit
def normalised_inputs(qn_ptr, kn_ptr, bn_ptr, gc_ptr, rows, p_k, m_k):
    """One chunk's float32 ``q̂``, ``k̂``, ``β``, cumulative log gate and ``bad`` tokens as
    :func:`kda_fwd_norm_kernel` wrote them (``bad``: ``β`` written NaN; it enters as 0)."""
    b_q = tl.load(qn_ptr + p_k, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_k = tl.load(kn_ptr + p_k, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_gc = tl.load(gc_ptr + p_k, mask=m_k[None, :], other=0.0)
    b_beta = tl.load(bn_ptr + rows)
    bad = b_beta != b_beta
    return b_q, b_k, tl.where(bad, 0.0, b_beta), b_gc, bad


@triton.jit
def kda_fwd_wy_kernel(
    qn_ptr,
    kn_ptr,
    v_ptr,
    bn_ptr,
    gc_ptr,
    kk_ptr,
    tdiag_ptr,
    NT,
    H,
    qg_ptr,
    kg_ptr,
    w_ptr,
    u_ptr,
    decay_ptr,
    t_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    STORE_FACTORS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NARROW: tl.constexpr,
):
    """Grid ``(NT, B·H)``, a per-channel gate's: :func:`chunk_factors` of one chunk from
    :func:`kda_fwd_norm_kernel`'s normalised inputs (the scale applied, the gates floored and
    summed) and :func:`kda_fwd_intra_kernel`'s decayed ``K Kᵀ`` and diagonal blocks'
    inverses."""
    o_c, o_k, m_k, rows, p_k, slot = chunk_tiles(H, NT, K, C, BK)
    b_q, b_k, b_beta, b_gc, bad = normalised_inputs(qn_ptr, kn_ptr, bn_ptr, gc_ptr, rows, p_k, m_k)
    b_kk = tl.load(kk_ptr + rows[:, None] * C + o_c[None, :])
    same_block = (o_c // SUB)[:, None] == (o_c // SUB)[None, :]
    b_tdiag = tl.load(tdiag_ptr + rows[:, None] * C + o_c[None, :], mask=same_block, other=0.0)
    chunk_factors(
        b_q, b_k, b_beta, b_gc, bad, b_kk, b_tdiag, v_ptr, rows, p_k, slot, o_c, o_k, m_k,
        qg_ptr, kg_ptr, w_ptr, u_ptr, decay_ptr, t_ptr,
        K, V, C, BV, K, STORE_FACTORS, DOT_PRECISION, NARROW,
    )  # fmt: skip


@triton.jit
def chunk_factors(
    b_q,
    b_k,
    b_beta,
    b_gc,
    bad,
    b_kk,
    b_tdiag,
    v_ptr,
    rows,
    p_k,
    slot,
    o_c,
    o_k,
    m_k,
    qg_ptr,
    kg_ptr,
    w_ptr,
    u_ptr,
    decay_ptr,
    t_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    STORE_FACTORS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NARROW: tl.constexpr,
):
    """From one chunk's ``q``, ``k`` (normalised, ``q`` scaled), ``β``, cumulative gate,
    decayed ``K Kᵀ`` and, where given, the inverses of ``I + A``'s diagonal blocks
    (``b_tdiag``; ``None``: computed here): ``q ⊙ exp(G)``, ``k ⊙ exp(G_C − G)`` ([B, T, H, K], the input dtype),
    ``W`` [B, T, H, K], ``U`` [B, T, H, V] (input dtype), the decay ``exp(G_C)``
    [B, NT, H, GK] and, with ``STORE_FACTORS``, ``T`` [B, T, H, C] (float32). ``NARROW``:
    ``W`` and ``U``'s products take operands in the factors' dtype (bf16 for bf16 inputs)
    instead of float32; ``T`` itself is float32 either way."""
    # each tile is stored as soon as it is final, which keeps few of them live at once
    dt = qg_ptr.dtype.element_ty
    if GK == 1:
        b_glast = tl.sum(tl.where(o_c == C - 1, b_gc, 0.0), axis=0)
        b_gamma = tl.exp(b_gc)[:, None]
        b_to_end = tl.exp(b_glast - b_gc)[:, None]
        tl.store(decay_ptr + slot, tl.exp(b_glast))
    else:
        b_glast = tl.sum(tl.where(o_c[:, None] == C - 1, b_gc, 0.0), axis=0)
        b_gamma = tl.exp(b_gc)
        b_to_end = tl.exp(b_glast[None, :] - b_gc)
        p_d = decay_ptr + slot * K + o_k
        tl.store(p_d, tl.exp(b_glast), mask=m_k)
    tl.store(qg_ptr + p_k, (b_q * b_gamma).to(dt), mask=m_k[None, :])
    tl.store(kg_ptr + p_k, (b_k * b_to_end).to(dt), mask=m_k[None, :])
    b_a = tl.where(o_c[:, None] > o_c[None, :], b_beta[:, None] * b_kk, 0.0)
    if b_tdiag is None:
        b_t = unit_lower_inverse(b_a, o_c, C, DOT_PRECISION)
    else:
        b_t = merge_block_inverses(b_tdiag, b_a, o_c, C, DOT_PRECISION)
    if STORE_FACTORS:
        tl.store(t_ptr + rows[:, None] * C + o_c[None, :], b_t)
    b_tw = b_t.to(dt) if NARROW else b_t
    b_kb = b_beta[:, None] * b_k * b_gamma
    b_w = tl.dot(b_tw, b_kb.to(b_tw.dtype), input_precision=DOT_PRECISION)
    tl.store(w_ptr + p_k, b_w.to(dt), mask=m_k[None, :])
    # a token with a non-finite key, beta or gate has its value NaN-marked
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    p_v = rows[:, None] * V + o_v[None, :]
    b_v = tl.load(v_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
    ok_v = finite(b_v) & ~bad[:, None]
    b_v = tl.where(ok_v, b_v, 0.0)
    first = tl.min(tl.where(ok_v, C, o_c[:, None]), axis=0)  # [BV]: first non-finite token
    b_u = tl.dot(b_tw, (b_beta[:, None] * b_v).to(b_tw.dtype), input_precision=DOT_PRECISION)
    b_u = tl.where(o_c[:, None] >= first[None, :], float("nan"), b_u)
    tl.store(u_ptr + p_v, b_u.to(dt), mask=m_v[None, :])


@triton.jit
def kda_fwd_h_kernel(
    kg_ptr,
    w_ptr,
    u_ptr,
    decay_ptr,
    init_ptr,
    flags_ptr,
    NT,
    H,
    R,
    final_ptr,
    hs_ptr,
    vn_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), B·H)``: each chunk's starting state ``[B, H, NT, K, V]``, ``V'``
    ``[B, T, H, V]`` (both in their outputs' dtype: float32 for the backward, else the input
    dtype) and the final states ``[B·R, H, K, V]`` (float32) of one (V block, batch row, head).
    The state is float32; its products take the input dtype's operands."""
    i_b, i_h, i_bh, o_k, o_v, o_c, m_k, m_v, m_kv, o_kv, row0 = walk_tiles(H, NT, K, V, C, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(NT):
        first, last, state = chunk_flags(flags_ptr, i_n, i_b, i_h, R, H, K, V)
        b_init = tl.load(init_ptr + state + o_kv, mask=m_kv & first, other=0.0)
        b_h = tl.where(first, b_init, b_h)
        p_h = hs_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V + o_kv
        tl.store(p_h, b_h.to(hs_ptr.dtype.element_ty), mask=m_kv)
        rows = row0 + (i_n * C + o_c) * H
        p_k = rows[:, None] * K + o_k[None, :]
        p_v = rows[:, None] * V + o_v[None, :]
        b_w = tl.load(w_ptr + p_k, mask=m_k[None, :], other=0.0)
        b_kg = tl.load(kg_ptr + p_k, mask=m_k[None, :], other=0.0)
        b_u = tl.load(u_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PRECISION)
        tl.store(vn_ptr + p_v, b_vn.to(vn_ptr.dtype.element_ty), mask=m_v[None, :])
        d_row = (i_b.to(tl.int64) * NT + i_n) * H + i_h
        if GK == 1:
            b_h = b_h * tl.load(decay_ptr + d_row)
        else:
            b_h = b_h * tl.load(decay_ptr + d_row * K + o_k, mask=m_k, other=0.0)[:, None]
        b_h += tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype), input_precision=DOT_PRECISION)
        b_h = tl.where(m_k[:, None], b_h, 0.0)  # padding rows stay 0 (a NaN row: 0 · NaN)
        tl.store(final_ptr + state + o_kv, b_h, mask=m_kv & last)


@triton.jit
def kda_fwd_o_kernel(
    qg_ptr,
    p_ptr,
    hs_ptr,
    vn_ptr,
    NT,
    H,
    o_ptr,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NARROW: tl.constexpr,
):
    """Grid ``(NT, cdiv(V, BV), B·H)``: one chunk's outputs ``o = (q ⊙ exp(G)) S + P V'``
    ``[B, T, H, V]`` for a V block, from its starting state ``S`` and ``V'`` (``NARROW``:
    ``P V'`` on operands in ``V'``'s dtype)."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_c, o_k = tl.arange(0, C), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + o_c) * H
    p_v = rows[:, None] * V + o_v[None, :]
    b_qg = tl.load(qg_ptr + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    p_h = hs_ptr + (i_bh.to(tl.int64) * NT + i_n) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vn = tl.load(vn_ptr + p_v, mask=m_v[None, :], other=0.0).to(tl.float32)
    b_p = tl.load(p_ptr + rows[:, None] * C + o_c[None, :])
    # P V' multiplies the zeros above P's diagonal too: NaN rows enter it as zeros, and each
    # channel's outputs are NaN from its first NaN row on
    nan_v = b_vn != b_vn
    poisoned = tl.cumsum(nan_v.to(tl.int32), axis=0) > 0
    b_o = tl.dot(b_qg, b_h.to(b_qg.dtype), input_precision=DOT_PRECISION)
    b_vc = tl.where(nan_v, 0.0, b_vn)
    if NARROW:
        b_p, b_vc = b_p.to(vn_ptr.dtype.element_ty), b_vc.to(vn_ptr.dtype.element_ty)
    b_o += tl.dot(b_p, b_vc, input_precision=DOT_PRECISION)
    b_o = tl.where(poisoned, float("nan"), b_o)
    tl.store(o_ptr + p_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v[None, :])
