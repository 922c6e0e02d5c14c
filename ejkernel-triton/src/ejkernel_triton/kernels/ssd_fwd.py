"""Triton Mamba-2 SSD, forward: chunked state-space duality with one scalar decay per (token,
head) (Dao and Gu, "Transformers are SSMs", ICML 2024, Sec. 6-7).

Kernel signatures follow jax-triton's order: inputs (arrays, then scalars), outputs, constexprs.
The kernels read the op's own arrays, unpadded: ``x`` [B, S, H, P], ``B`` and ``C``
[B, S, NG, N] in ``x``'s dtype (head h reads group ``h // (H / NG)``; nothing is repeated per
head) and the gate ``z`` [B, S, H, P] in its own; tokens past ``S`` in the last chunk load as
zeros.
Two float32 arrays ``[B, T, H]`` with ``T = NT · C`` (zero past ``S``) carry the time step
``Δ`` and ``G``, the cumulative log decay *within* each chunk (``G[t] = Σ Δ A`` from the chunk
start through ``t``): a zero step adds nothing to the state and a zero log decay keeps it.
The value ``u = Δ x`` is formed in the kernels (float32, rounded to ``x``'s dtype for the dots).

Two kernels, in the state's transposed layout ``hᵀ [N, P]``:

- :func:`ssd_fwd_h_kernel` walks the chunks of a (batch row, head) in order, carrying
  ``hᵀ`` in float32: ``hᵀ ← hᵀ · exp(G_last) + (B ⊙ exp(G_last − G))ᵀ u``; it stores the
  state at every chunk start (what the output kernel reads) and the final state.
- :func:`ssd_fwd_o_kernel`: ``y = exp(G) ⊙ (C hᵀ) + M u`` with the intra-chunk matrix
  ``M[i, j] = (C_i · B_j) exp(G_i − G_j)`` (j ≤ i), then ``out = (y + D x) ⊙ silu(z)``.
  The decay is one scalar per token, so ``M`` is one ``tl.dot`` over N and one ``[C, C]``
  exponential, and the inter-chunk term's decay is a row scale after its dot.

A NaN input stays in its causal future, as in the recurrence: ``M``'s entries above the
diagonal are selected away (never multiplied by 0), their exponent masked before the ``exp``
(no Inf from the positive differences), and a non-finite ``u`` is kept out of ``M u``'s
earlier rows (its column is NaN from its row on).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def walk_program(S, NT, H, NG, N, P, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A state walk's place (grid ``(cdiv(N, BK), cdiv(P, BV), B·H)``): its batch row and
    head, the ``N``/``P`` offsets and masks of its ``hᵀ [BK, BV]`` tile, the tile's offsets in
    the per-chunk states ``[N, P]`` (``p_tiles``: its first chunk's, ``o_kv``: within a chunk)
    and in the op's ``[P, N]`` states (``state``: its base, ``o_state``), and the first token
    of its row in ``[B, S, …]`` and in the ``[B, T, H]`` gates."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < N, o_v < P
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * P + o_v[None, :]
    o_state = o_v[None, :] * N + o_k[:, None]  # hᵀ[k, v] is the op's state[v, k]
    state = i_bh.to(tl.int64) * P * N
    p_tiles = i_bh.to(tl.int64) * NT * N * P
    tok0 = i_b.to(tl.int64) * S  # token t of this batch row in [B, S, ...]: tok0 + t
    row0 = i_b.to(tl.int64) * NT * C * H + i_h  # token t in [B, T, H]: row0 + t * H
    return i_h, o_k, o_v, m_k, m_v, m_kv, o_kv, o_state, state, p_tiles, tok0, row0


@triton.jit
def walk_chunk(nc_ptr, g_ptr, i_n, tok0, row0, o_k, m_k, S, H, NG, N, C: tl.constexpr, i_h):
    """A state walk's step at chunk ``i_n``: its tokens' rows in ``[B, S, …]`` and their
    mask, the group's ``B`` or ``C`` rows (``nc_ptr``) as ``[BK, C]`` (the transposed
    operand), and the chunk's ``G`` and last ``G``."""
    o_t = i_n * C + tl.arange(0, C)
    m_t = o_t < S
    tok = tok0 + o_t
    p_t = nc_ptr + (tok[None, :] * NG + i_h // (H // NG)) * N + o_k[:, None]
    b_t = tl.load(p_t, mask=m_k[:, None] & m_t[None, :], other=0.0)
    b_g = tl.load(g_ptr + row0 + o_t * H)
    b_glast = tl.load(g_ptr + row0 + (i_n * C + C - 1) * H)
    return o_t, m_t, tok, b_t, b_g, b_glast


@triton.jit
def chunk_program(dt_ptr, g_ptr, S, NT, H, NG, C: tl.constexpr):
    """A per-chunk program's place (grid ``(blocks, NT, B·H)``): its chunk, batch row, head
    and group, the chunk's offsets, its tokens and their mask, their rows in ``[B, S, …]``,
    and the chunk's ``Δ``, ``G`` and last ``G``."""
    i_n, i_bh = tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, C)
    o_t = i_n * C + o_c
    row0 = i_b.to(tl.int64) * NT * C * H + i_h
    b_g = tl.load(g_ptr + row0 + o_t * H)
    b_dt = tl.load(dt_ptr + row0 + o_t * H)
    b_glast = tl.load(g_ptr + row0 + (i_n * C + C - 1) * H)
    tok = i_b.to(tl.int64) * S + o_t
    return i_n, i_b, i_bh, i_h, i_h // (H // NG), o_c, o_t, o_t < S, tok, b_g, b_dt, b_glast


@triton.jit
def causal_decay(b_g, o_c):
    """The chunk's causal mask (j ≤ i) and ``exp(G_i − G_j)`` under it (masked before the
    exponential: no Inf from the positive differences; 0 above the diagonal)."""
    causal = o_c[:, None] >= o_c[None, :]
    return causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], float("-inf")))


@triton.jit
def ssd_fwd_h_kernel(
    x_ptr,
    b_ptr,
    dt_ptr,
    g_ptr,
    init_ptr,
    S,
    NT,
    H,
    NG,
    h_ptr,
    final_ptr,
    N: tl.constexpr,
    P: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(N, BK), cdiv(P, BV), B·H)``: the chunk-start states ``hᵀ``
    ``[B, H, NT, N, P]`` (``x``'s dtype) and the final state ``[B, H, P, N]`` (float32, the
    op's layout; ``init_ptr`` the initial one, likewise) of one (N block, P block, batch row,
    head)."""
    i_h, o_k, o_v, m_k, m_v, m_kv, o_kv, o_state, state, p_tiles, tok0, row0 = walk_program(
        S, NT, H, NG, N, P, C, BK, BV
    )
    b_h = tl.load(init_ptr + state + o_state, mask=m_kv, other=0.0)
    for i_n in range(NT):
        tl.store(h_ptr + p_tiles + i_n * N * P + o_kv, b_h.to(h_ptr.dtype.element_ty), mask=m_kv)
        o_t, m_t, tok, b_bt, b_g, b_glast = walk_chunk(
            b_ptr, g_ptr, i_n, tok0, row0, o_k, m_k, S, H, NG, N, C, i_h
        )
        p_x = x_ptr + (tok[:, None] * H + i_h) * P + o_v[None, :]
        b_x = tl.load(p_x, mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_dt = tl.load(dt_ptr + row0 + o_t * H)
        b_u = (b_x.to(tl.float32) * b_dt[:, None]).to(b_x.dtype)
        b_bd = (b_bt * tl.exp(b_glast - b_g)[None, :]).to(b_x.dtype)
        b_h = b_h * tl.exp(b_glast) + tl.dot(b_bd, b_u, input_precision=DOT_PRECISION)
    tl.store(final_ptr + state + o_state, b_h, mask=m_kv)


@triton.jit
def ssd_fwd_o_kernel(
    x_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    g_ptr,
    h_ptr,
    d_ptr,
    S,
    NT,
    H,
    NG,
    o_ptr,
    N: tl.constexpr,
    P: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_GATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(P, BV), NT, B·H)``: ``out = (exp(G) ⊙ (C hᵀ) + M u + D x) ⊙ silu(z)``
    of one chunk (``[B, S, H, P]``, ``x``'s dtype; ``z`` read only when ``HAS_GATE``; ``D``
    float32 per head)."""
    i_n, _, i_bh, i_h, i_g, o_c, _, m_t, tok, b_g, b_dt, _ = chunk_program(
        dt_ptr, g_ptr, S, NT, H, NG, C
    )
    o_v = tl.program_id(0) * BV + tl.arange(0, BV)
    m_v = o_v < P
    m_tv = m_t[:, None] & m_v[None, :]
    p_x = (tok[:, None] * H + i_h) * P + o_v[None, :]
    b_x = tl.load(x_ptr + p_x, mask=m_tv, other=0.0)
    dt = b_x.dtype
    b_u = b_x.to(tl.float32) * b_dt[:, None]
    # M u multiplies the zeros above M's diagonal too: non-finite values enter it as zeros,
    # and each one's column is NaN from its row on (as the recurrence's state would be)
    bad = ~(tl.abs(b_u) < float("inf"))
    b_u = tl.where(bad, 0.0, b_u).to(dt)
    poisoned = tl.cumsum(bad.to(tl.int32), axis=0) > 0
    p_h = h_ptr + (i_bh.to(tl.int64) * NT + i_n) * N * P
    b_o = tl.zeros([C, BV], dtype=tl.float32)
    b_s = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, N, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < N
        p_bc = (tok[:, None] * NG + i_g) * N + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_c = tl.load(c_ptr + p_bc, mask=m_tk, other=0.0)
        b_b = tl.load(b_ptr + p_bc, mask=m_tk, other=0.0)
        b_h = tl.load(
            p_h + o_k[:, None] * P + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0
        )
        b_o += tl.dot(b_c, b_h.to(dt), input_precision=DOT_PRECISION)
        b_s += tl.dot(b_c, tl.trans(b_b), input_precision=DOT_PRECISION)
    b_o = b_o * tl.exp(b_g)[:, None]
    causal, b_decay = causal_decay(b_g, o_c)
    b_m = tl.where(causal, b_s * b_decay, 0.0)
    b_o += tl.dot(b_m.to(dt), b_u, input_precision=DOT_PRECISION)
    b_o = tl.where(poisoned, float("nan"), b_o)
    b_o += tl.load(d_ptr + i_h) * b_x.to(tl.float32)
    if HAS_GATE:
        b_z = tl.load(z_ptr + p_x, mask=m_tv, other=0.0).to(tl.float32)
        b_o = b_o * b_z * tl.sigmoid(b_z)
    tl.store(o_ptr + p_x, b_o.to(o_ptr.dtype.element_ty), mask=m_tv)
