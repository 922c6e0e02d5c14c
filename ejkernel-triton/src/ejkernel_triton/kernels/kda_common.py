"""The chunk algebra of the Triton gated delta rule that its forward and backward kernels share
(:mod:`ejkernel_triton.kernels.kda_fwd`, :mod:`ejkernel_triton.kernels.kda_bwd`): reading one
chunk's inputs with the numerics of :mod:`ejkernel_xla.ops._chunk_numerics`, a per-head gate's
decayed products ``P`` and ``K Kᵀ`` and their VJP, and the unit lower-triangular inverse
``T = (I + A)⁻¹``.

A chunk is ``C`` consecutive rows of the ``[B, T, H, F]`` chunk layout; ``rows`` are their
flat (token, head) indices, ``p_k = rows · K + κ`` the offsets of their ``BK`` key channels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.channel_products import SUB


@triton.jit
def walk_tiles(
    H, NT, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    """The indices of a sequential walk's program (grid ``(cdiv(V, BV), B·H)``): batch row,
    head, their flat index, the key/value/chunk offsets, the ``[BK, BV]`` state tile's mask and
    offsets, and the flat row of the batch row's first token of this head."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    row0 = i_b.to(tl.int64) * NT * C * H + i_h
    return i_b, i_h, i_bh, o_k, o_v, tl.arange(0, C), m_k, m_v, m_kv, o_kv, row0


@triton.jit
def chunk_tiles(H, NT, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """The indices of a per-chunk program (grid ``(NT, B·H)``): the chunk/key offsets and key
    mask, the chunk's flat rows and the offsets of their ``BK`` key channels, and the chunk's
    slot in ``[B, NT, H]`` per-chunk arrays."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    rows = i_b.to(tl.int64) * NT * C * H + i_h + (i_n * C + o_c) * H
    p_k = rows[:, None] * K + o_k[None, :]
    slot = (i_b.to(tl.int64) * NT + i_n) * H + i_h
    return o_c, o_k, m_k, rows, p_k, slot


@triton.jit
def chunk_flags(flags_ptr, i_n, i_b, i_h, R, H, K: tl.constexpr, V: tl.constexpr):
    """Chunk ``i_n``'s flag word (``sid << 2 | last << 1 | first``): whether it starts and ends
    its sequence, and the offset of its state row ``[K, V]`` in the ``[B·R, H, K, V]`` states."""
    flags = tl.load(flags_ptr + i_n)
    state = ((i_b * R + (flags >> 2)).to(tl.int64) * H + i_h) * K * V
    return (flags & 1) != 0, (flags & 2) != 0, state


@triton.jit
def finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def gate_ok(g):
    """A gate may be -inf (a reset); NaN and +inf are not finite inputs."""
    return (g == g) & (g != float("inf"))


@triton.jit
def chunk_inputs(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    rows,
    p_k,
    m_k,
    GK: tl.constexpr,
    GATE_FLOOR: tl.constexpr,
):
    """One chunk's float32 ``q``, ``k`` ``[C, BK]``, ``β`` ``[C]`` and log gate (``[C]`` for
    ``GK = 1``, else ``[C, BK]``), and ``bad [C]``: the tokens whose key, ``β`` or gate is not
    finite, which enter with key, ``β`` and gate zeroed. Gates are floored at
    ``-GATE_FLOOR``; ``live`` (the gate's shape) marks the entries the floor leaves as they
    are (where a gradient reaches the gate)."""
    b_q = tl.load(q_ptr + p_k, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + p_k, mask=m_k[None, :], other=0.0).to(tl.float32)
    b_beta = tl.load(beta_ptr + rows).to(tl.float32)
    bad = tl.sum((~finite(b_k)).to(tl.int32), axis=1) > 0
    bad = bad | ~finite(b_beta)
    if GK == 1:
        b_g = tl.load(g_ptr + rows).to(tl.float32)
        bad = bad | ~gate_ok(b_g)
        live = ~bad & (b_g >= -GATE_FLOOR)
        b_g = tl.where(bad, 0.0, b_g)
    else:
        b_g = tl.load(g_ptr + p_k, mask=m_k[None, :], other=0.0).to(tl.float32)
        bad = bad | (tl.sum((~gate_ok(b_g)).to(tl.int32), axis=1) > 0)
        live = ~bad[:, None] & (b_g >= -GATE_FLOOR)
        b_g = tl.where(bad[:, None], 0.0, b_g)
    b_g = tl.where(b_g < -GATE_FLOOR, -GATE_FLOOR, b_g)
    b_k = tl.where(bad[:, None], 0.0, b_k)
    b_beta = tl.where(bad, 0.0, b_beta)
    return b_q, b_k, b_beta, b_g, bad, live


@triton.jit
def l2_normalise(x):
    """Rows of ``x`` over their L2 norm (``√(Σx² + 1e-6)``), and the norms."""
    norm = tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
    return x / norm[:, None], norm


@triton.jit
def l2_normalise_bwd(x_hat, norm, d_hat):
    """The gradient of :func:`l2_normalise`'s input from its output's: ``(dx̂ − x̂ (x̂·dx̂)) / n``."""
    return (d_hat - x_hat * tl.sum(x_hat * d_hat, axis=1)[:, None]) / norm[:, None]


@triton.jit
def decayed_products(b_q, b_k, b_gc, o_c, DOT_PRECISION: tl.constexpr):
    """For a per-head gate ``G = b_gc [C]`` (cumulative): ``P_tj = Σ_κ q_tκ k_jκ
    exp(G_t − G_j)`` and ``(K Kᵀ)_tj`` likewise, for ``j ≤ t`` (zero above the diagonal):
    relative decays only (never a growth). A per-channel gate's are
    :func:`~ejkernel_triton.kernels.kda_fwd.kda_fwd_intra_kernel`'s."""
    causal = o_c[:, None] >= o_c[None, :]
    b_pair = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
    b_p = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_p = tl.where(causal, b_p * b_pair, 0.0)
    b_kk = tl.where(causal, b_kk * b_pair, 0.0)
    return b_p, b_kk


@triton.jit
def decayed_products_bwd(
    p_dpt, dm_slab, b_q, b_k, b_gc, o_c, C: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """Pull ``dP`` (of ``P = D(q, k)``) and ``dM`` (of ``M = D(k, k)``) back to ``(dq, dk
    through the rows' side, dk through the columns' side)``, for a per-head gate and
    ``D(a, b)_tj = Σ_κ a_tκ b_jκ exp(G_t − G_j)`` (``j ≤ t``):
    ``da_t = Σ_j dD_tj b_j exp(G_t − G_j)``, ``db_j = Σ_t dD_tj a_t exp(G_t − G_j)``; the
    gate's gradient is then ``a ⊙ da − b ⊙ db`` summed over both products.

    Both cotangents are read from memory in both orientations: ``dP_tj`` at ``p_dpt[j] + t``
    (``p_dpt [C]``: each token's row of ``dPᵀ``), ``dM_tj`` at ``dm_slab + t·C + j``; only
    their lower triangles (``j ≤ t``) are read."""
    o_cc = o_c[:, None] * C + o_c[None, :]
    o_tr = o_c[None, :] * C + o_c[:, None]
    causal = o_c[:, None] >= o_c[None, :]
    upper = o_c[:, None] <= o_c[None, :]
    b_dp = tl.load(p_dpt[None, :] + o_c[:, None], mask=causal, other=0.0)
    b_dpt = tl.load(p_dpt[:, None] + o_c[None, :], mask=upper, other=0.0)
    b_dm = tl.load(dm_slab + o_cc, mask=causal, other=0.0)
    b_dmt = tl.load(dm_slab + o_tr, mask=upper, other=0.0)
    b_e = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
    b_et = tl.exp(tl.where(upper, b_gc[None, :] - b_gc[:, None], float("-inf")))
    b_dq = tl.dot(b_dp * b_e, b_k, input_precision=DOT_PRECISION)
    b_dka = tl.dot(b_dm * b_e, b_k, input_precision=DOT_PRECISION)
    b_dkb = tl.dot(b_dpt * b_et, b_q, input_precision=DOT_PRECISION)
    b_dkb += tl.dot(b_dmt * b_et, b_k, input_precision=DOT_PRECISION)
    return b_dq, b_dka, b_dkb


@triton.jit
def unit_lower_inverse(b_a, o_c, C: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(I + A)⁻¹`` for a strictly lower ``A [C, C]``. First the diagonal blocks of
    :data:`SUB` rows, all blocks at once, by forward substitution: step ``i`` sets row ``i`` of
    every block to ``e_i − Σ_{j<i} A_ij T_j`` (one product, the earlier rows being final). Then
    :func:`merge_block_inverses`."""
    blk = o_c // SUB
    b_d = tl.where(blk[:, None] == blk[None, :], b_a, 0.0)
    b_t = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for i in range(1, SUB):
        b_row = tl.where((o_c % SUB == i)[:, None], b_d, 0.0)
        b_t -= tl.dot(b_row, b_t, input_precision=DOT_PRECISION)
    return merge_block_inverses(b_t, b_a, o_c, C, DOT_PRECISION)


@triton.jit
def block_inverse(b_a, o_s):
    """``(I + A)⁻¹`` for a strictly lower ``A [SUB, SUB]`` by forward substitution, row by
    row (``T_i = e_i − Σ_{j<i} A_ij T_j``), with reductions instead of products: one tile's
    work, for a program that holds a single diagonal block."""
    b_t = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
    for i in range(1, SUB):
        b_ai = tl.sum(tl.where((o_s == i)[:, None], b_a, 0.0), axis=0)  # row i of A
        b_r = tl.sum(b_ai[:, None] * b_t, axis=0)  # Σ_j A_ij T_j
        b_t = tl.where((o_s == i)[:, None], b_t - b_r[None, :], b_t)
    return b_t


@triton.jit
def merge_block_inverses(b_t, b_a, o_c, C: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(I + A)⁻¹`` from ``b_t``, the inverse of ``I +`` the diagonal blocks of :data:`SUB`
    rows of the strictly lower ``A [C, C]``: blocks of ``s`` rows pair into blocks of ``2 s``;
    with ``D`` the block diagonal of size ``s`` and ``L`` the lower-left ``s × s`` block of each
    pair, ``(D + L)⁻¹ = D⁻¹ − D⁻¹ L D⁻¹`` exactly (``L D⁻¹ L = 0``), two products a doubling."""
    if C >= 2 * SUB:
        b_t = _pair_blocks(b_t, b_a, o_c, SUB, DOT_PRECISION)
    if C >= 4 * SUB:
        b_t = _pair_blocks(b_t, b_a, o_c, 2 * SUB, DOT_PRECISION)
    if C >= 8 * SUB:
        b_t = _pair_blocks(b_t, b_a, o_c, 4 * SUB, DOT_PRECISION)
    return b_t


@triton.jit
def _pair_blocks(b_t, b_a, o_c, S: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The inverse on blocks of ``2 S`` rows from ``b_t``, the inverse on blocks of ``S``."""
    half = o_c // S
    lower_left = ((half[:, None] // 2) == (half[None, :] // 2)) & (half[:, None] > half[None, :])
    b_l = tl.where(lower_left, b_a, 0.0)
    b_lt = tl.dot(b_l, b_t, input_precision=DOT_PRECISION)
    return b_t - tl.dot(b_t, b_lt, input_precision=DOT_PRECISION)
