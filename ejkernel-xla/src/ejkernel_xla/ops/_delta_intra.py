"""Chunk math of the chunked gated delta rule on XLA (:mod:`ejkernel_xla.ops._delta_chunked`).

Per chunk: the decays, the WY factors by the UT transform (block-doubling triangular inverse),
the hierarchical decayed products with their hand-written VJPs, and the recurrence given the
incoming state; see :mod:`ejkernel_xla.ops.kernel_delta_attention` for the algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel_xla.ops._chunk_numerics import finite_part, poison

if TYPE_CHECKING:
    from ejkernel_xla.ops._delta_chunked import Statics

__all__ = ["Chunk", "Prepared", "dot", "recurrence", "ut_transform"]


class Chunk(NamedTuple):
    """Chunked inputs (float32), [M, B, H, C, ...]."""

    q: jax.Array  # normalised and scaled
    k: jax.Array
    v: jax.Array
    beta: jax.Array  # [..., C]
    g: jax.Array  # [..., C, K] or [..., C]


class Prepared(NamedTuple):
    """What the inter-chunk recurrence and the outputs need (none of it depends on the state)."""

    w: jax.Array  # [..., C, K]  T diag(β) (K ⊙ Γ)
    u: jax.Array  # [..., C, V]  T diag(β) V
    k_to_end: jax.Array  # [..., C, K]  K ⊙ exp(G_C - G)
    decay: jax.Array  # [..., K]  γ_C
    qk: jax.Array  # [..., C, C]  Σ_k q_t k_j exp(G_t - G_j), masked to j ≤ t
    q_decayed: jax.Array  # [..., C, K]  Q ⊙ Γ
    first: jax.Array  # [..., V] int32  first token with a non-finite input per channel, or C


def ut_transform(ch: Chunk, st: Statics, factor: bool = False) -> Prepared:
    """The state-independent part of every chunk: decays and the WY factors (UT transform).

    With ``factor`` (the streaming forward, one chunk of all heads at a time) per-channel
    decays take the factored products ``(x ⊙ Γ)(k ⊙ Γ⁻¹)ᵀ`` (two matmuls) whenever the
    chunk's cumulative decays stay within ±:data:`_FACTORED_RANGE` (a ``lax.cond`` on the
    chunk), else the hierarchical products; without it always the hierarchical ones.

    Tokens with a non-finite key, ``beta`` or decay enter with those and their value zeroed,
    non-finite value entries alone are zeroed, and :func:`recurrence` sets the outputs from
    such a token on to NaN (per value channel): the triangular products and inverse below
    would otherwise carry a later token's NaN into earlier rows (``0 · NaN``); see
    :mod:`ejkernel_xla.ops._chunk_numerics`.
    """
    q, k, v, beta, g, first = _finite_tokens(ch)
    c = q.shape[-2]
    t = jnp.arange(c)
    # Cumulative sums as a matmul with a triangle of ones: XLA on CPU would otherwise fuse the
    # scan (a reduce-window) into each consumer and redo it for every element.
    ones = (t[:, None] >= t[None, :]).astype(jnp.float32)
    if g.ndim == beta.ndim:  # one decay per head: [C, C] pairwise decays, masked before exp
        cum = dot("tj,...j->...t", ones, g)
        pair = jnp.exp(
            jnp.where(t[:, None] >= t[None, :], cum[..., :, None] - cum[..., None, :], -jnp.inf)
        )
        qk = dot("...tk,...jk->...tj", q, k) * pair
        kk = dot("...tk,...jk->...tj", k, k) * pair
        cum = cum[..., None]
    else:
        cum = dot("tj,...jk->...tk", ones, g)  # [..., C, K]
        if factor:
            qk, kk = _channel_products(q, k, g, cum)
        else:
            qk, kk = _decayed_products(q, k, g)
    gamma = jnp.exp(cum)
    a = beta[..., :, None] * jnp.where(t[:, None] > t[None, :], kk, 0.0)
    ut = _unit_lower_inverse(a)  # T = (I + A)⁻¹
    dk = k.shape[-1]
    sol = dot("...tj,...jf->...tf", ut, beta[..., None] * jnp.concatenate([k * gamma, v], axis=-1))
    return Prepared(
        w=sol[..., :dk],
        u=sol[..., dk:],
        k_to_end=k * jnp.exp(cum[..., -1:, :] - cum),
        decay=jnp.broadcast_to(gamma[..., -1, :], (*k.shape[:-2], dk)),
        qk=qk,
        q_decayed=q * gamma,
        first=first,
    )


def _finite_tokens(ch: Chunk) -> tuple[jax.Array, ...]:
    """``(q, k, v, beta, g, first)``: a token whose key, ``beta`` or decay has a non-finite
    entry gets them all and its value zeroed, a non-finite value entry alone is zeroed;
    ``first`` [..., V] is the first such token per value channel (C when none)."""
    q, k, v, beta, g = ch
    per_token = lambda x: jnp.all(jnp.isfinite(x), axis=-1)
    vector = g.ndim > beta.ndim
    ok = per_token(k) & jnp.isfinite(beta) & (per_token(g) if vector else jnp.isfinite(g))
    k = jnp.where(ok[..., None], k, 0.0)
    beta = jnp.where(ok, beta, 0.0)
    g = jnp.where(ok[..., None] if vector else ok, g, 0.0)
    v, first = finite_part(v, also=ok[..., None])
    return q, k, v, beta, g, first


#: Largest spread of a chunk's cumulative log decays (chunk start included) for which the
#: factored products run: every factor exp(±G) stays within exp(±80), short of float32's
#: overflow (exp(88.7)) and of its subnormals (exp(-87.3)).
_FACTORED_RANGE = 80.0


def _channel_products(
    q: jax.Array, k: jax.Array, g: jax.Array, cum: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`_decayed_products` for one chunk of all heads, factored through the chunk start
    when its decays allow: ``exp(G_t - G_j) = exp(G_t) · exp(-G_j)``, so both products are
    one [2C, K] × [K, C] matmul per head (lower triangle kept, diagonal included)."""
    spread = jnp.maximum(jnp.max(cum), 0.0) - jnp.minimum(jnp.min(cum), 0.0)

    def factored() -> tuple[jax.Array, jax.Array]:
        c = q.shape[-2]
        t = jnp.arange(c)
        e = jnp.exp(cum)
        both = dot("...tk,...jk->...tj", jnp.concatenate([q * e, k * e], axis=-2), k / e)
        both = jnp.where(t[:, None] >= t[None, :], both.reshape(*both.shape[:-2], 2, c, c), 0.0)
        return both[..., 0, :, :], both[..., 1, :, :]

    # The factored products are computed outside the conditional, which only passes them on
    # or builds the hierarchical ones instead (their factors overflow there and are dropped):
    # inside the branch they would not overlap the rest of the step on XLA:CPU, about 16 %
    # slower at B 8, H 16, K = V = 128.
    fast = factored()
    return lax.cond(spread <= _FACTORED_RANGE, lambda: fast, lambda: _decayed_products(q, k, g))


def recurrence(p: Prepared, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk given its incoming state: ``U = Ũ - W S₀``, ``O = (Q ⊙ Γ) S₀ + P U`` and
    ``S_C = diag(γ_C) S₀ + (K ⊙ exp(G_C - G))ᵀ U``; NaN from the first token with a
    non-finite input on (per value channel, the next state's too)."""
    u = p.u - dot("...ck,...kv->...cv", p.w, state)
    out = dot("...ck,...kv->...cv", p.q_decayed, state) + dot("...tj,...jv->...tv", p.qk, u)
    # From the first non-finite input on, the outputs and the rows of U that enter the next
    # state are NaN (a NaN row turns its state columns NaN, as the recurrence's would be).
    u = poison(u, p.first)
    new = p.decay[..., None] * state + dot("...ck,...cv->...kv", p.k_to_end, u)
    return poison(out, p.first), new


@jax.custom_vjp
def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)⁻¹`` for strictly lower-triangular ``a [..., C, C]``, by block doubling.

    Diagonal blocks of size b are inverted, then pairs merge:
    ``[[T₀, 0], [A₁₀, T₁]]⁻¹ = [[T₀, 0], [-T₁ A₁₀ T₀, T₁]]`` (log₂ C batched steps; C is
    padded to a power of two with identity rows). Its VJP is the inverse's:
    ``dA = -(Tᵀ dT Tᵀ)`` on the strictly lower triangle.
    """
    c = a.shape[-1]
    size = 1 << max(0, (c - 1).bit_length())
    lead = a.shape[:-2]
    if size != c:
        a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, size - c), (0, size - c)])
    inv = jnp.ones((*lead, size, 1, 1), a.dtype)
    b = 1
    while b < size:
        n = size // (2 * b)
        below = _lower_blocks(a, b)  # [..., n, b, b]: block (2i+1, 2i)
        pairs = inv.reshape(*lead, n, 2, b, b)
        t0, t1 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -dot("...ij,...jk->...ik", t1, dot("...ij,...jk->...ik", below, t0))
        inv = _merge(inv, corner, n, b)
        b *= 2
    return inv[..., 0, :c, :c]


def _unit_lower_inverse_fwd(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    t = _unit_lower_inverse(a)
    return t, t


def _unit_lower_inverse_bwd(t: jax.Array, d_t: jax.Array) -> tuple[jax.Array]:
    c = t.shape[-1]
    i = jnp.arange(c)
    d_a = -dot("...ji,...jk->...ik", t, dot("...ij,...kj->...ik", d_t, t))
    return (jnp.where(i[:, None] > i[None, :], d_a, 0.0),)


_unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _decayed_products(q: jax.Array, k: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``Σ_κ x_t[κ] k_j[κ] exp(G_t[κ] - G_j[κ])`` for x = q and x = k, for ``j ≤ t``
    (``G`` the cumulative sum of the log decays ``g`` [..., C, K] inside the chunk).

    Hierarchically, without one factor above 1: the chunk is halved recursively, and the block
    of rows t in the second half and columns j in the first half of one block factors through
    the end ``m`` of the first half: ``exp(G_t - G_m) · exp(G_m - G_j)``, both ``≤ 1`` for
    ``g ≤ 0``, so the block is a matmul of decayed rows. The blocks of the log₂ C levels tile
    the strictly lower triangle; the diagonal has no decay. The factors are products of the
    per-token decays ``exp(g)`` within each block (prefix products for rows, suffix products
    for columns), built level by level from the previous one: C·K exponentials per chunk, and a
    ``C × C × K`` product. Returns two ``[..., C, C]`` arrays, zero above the diagonal.
    """
    *lead, c, _ = q.shape
    size = 1 << max(0, (c - 1).bit_length())
    if size != c:  # pad to a power of two with empty tokens that do not decay
        pad = [(0, 0)] * len(lead) + [(0, size - c), (0, 0)]
        q, k, g = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(g, pad)
    qk, kk = _gram(q, k, g)
    return qk[..., :c, :c], kk[..., :c, :c]


def _halves(x: jax.Array, b: int) -> jax.Array:
    """[..., C, K] -> [..., C / 2b, 2, b, K]: blocks of 2b rows, split in halves."""
    *lead, c, dk = x.shape
    return x.reshape(*lead, c // (2 * b), 2, b, dk)


def _bridges(g: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per level (half size b = 1, 2, 4, ...), the decays through the middle ``m`` of each 2b
    block: ``exp(G_t - G_m)`` for the rows of its second half and ``exp(G_m - G_j)`` for the
    rows of its first half, each [..., C / 2b, b, K] and ``≤ 1``.

    ``prefix`` holds the product of ``exp(g)`` from the start of the token's b-block through
    it, ``suffix`` from after it to the end of its b-block; merging two b-blocks multiplies the
    second half's prefixes by the first half's total and the first half's suffixes by the
    second half's total.
    """
    prefix = jnp.exp(g)
    suffix = jnp.ones_like(prefix)
    out = []
    for b in _levels(g.shape[-2]):
        ph, sh = _halves(prefix, b), _halves(suffix, b)
        out.append((ph[..., 1, :, :], sh[..., 0, :, :]))
        first_total, second_total = ph[..., 0, -1:, :], ph[..., 1, -1:, :]
        prefix = jnp.stack([ph[..., 0, :, :], ph[..., 1, :, :] * first_total], axis=-3).reshape(
            g.shape
        )
        suffix = jnp.stack([sh[..., 0, :, :] * second_total, sh[..., 1, :, :]], axis=-3).reshape(
            g.shape
        )
    return out


def _lower_blocks(m: jax.Array, b: int) -> jax.Array:
    """[..., C, C] -> its blocks (second half, first half) of each 2b block: [..., C / 2b, b, b]."""
    *lead, c, _ = m.shape
    n = c // (2 * b)
    grid = m.reshape(*lead, n, 2, b, n, 2, b)
    blocks = jnp.diagonal(grid[..., :, 1, :, :, 0, :], axis1=-4, axis2=-2)  # [..., b, b, n]
    return jnp.moveaxis(blocks, -1, -3)


def _levels(c: int) -> list[int]:
    return [1 << i for i in range(max(0, (c - 1).bit_length()))]


@jax.custom_vjp
def _gram(q: jax.Array, k: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`_decayed_products` for C a power of two."""
    blocks_q = dot("...tk,...tk->...t", q, k)[..., None, None]  # [..., C, 1, 1]
    blocks_k = dot("...tk,...tk->...t", k, k)[..., None, None]
    for b, (rows, cols) in zip(_levels(q.shape[-2]), _bridges(g)):
        cols = _halves(k, b)[..., 0, :, :] * cols
        n = rows.shape[-3]
        blocks_q = _merge(
            blocks_q, dot("...ik,...jk->...ij", _halves(q, b)[..., 1, :, :] * rows, cols), n, b
        )
        blocks_k = _merge(
            blocks_k, dot("...ik,...jk->...ij", _halves(k, b)[..., 1, :, :] * rows, cols), n, b
        )
    return blocks_q[..., 0, :, :], blocks_k[..., 0, :, :]


def _gram_fwd(q: jax.Array, k: jax.Array, g: jax.Array) -> tuple[Any, Any]:
    return _gram(q, k, g), (q, k, g)


def _gram_bwd(res: Any, cot: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
    """With ``P_tj = Σ_κ x_tκ y_jκ e_tjκ``: ``dx = D(dP, y)``, ``dy = Dᵀ(dP, x)`` for the
    decayed products ``D(M, y)_t = Σ_{j ≤ t} M_tj y_j e_tj`` (same hierarchy as the forward),
    and ``dG = x ⊙ dx - y ⊙ dy`` (the diagonal carries no decay, and its terms cancel); then
    ``dg_s = Σ_{t ≥ s} dG_t``."""
    q, k, g = res
    c = q.shape[-2]
    t = jnp.arange(c)
    lower = t[:, None] >= t[None, :]
    d_qk, d_kk = (jnp.where(lower, d, 0.0) for d in cot)
    bridges = _bridges(g)
    dq = _decayed(d_qk, k, bridges, transpose=False)
    dk_cols = _decayed(d_qk, q, bridges, transpose=True)
    dk_rows_kk = _decayed(d_kk, k, bridges, transpose=False)
    dk_cols_kk = _decayed(d_kk, k, bridges, transpose=True)
    d_cum = q * dq - k * dk_cols + k * (dk_rows_kk - dk_cols_kk)
    d_g = dot("ts,...tk->...sk", lower.astype(jnp.float32), d_cum)
    return dq, dk_cols + dk_rows_kk + dk_cols_kk, d_g


_gram.defvjp(_gram_fwd, _gram_bwd)


def _decayed(m: jax.Array, y: jax.Array, bridges: list[Any], *, transpose: bool) -> jax.Array:
    """``D(m, y)_t = Σ_{j ≤ t} m_tj y_j exp(G_t - G_j)`` for lower-triangular ``m`` [..., C, C];
    with ``transpose``, ``Dᵀ(m, y)_j = Σ_{t ≥ j} m_tj y_t exp(G_t - G_j)``.

    At each level the lower block couples one half to the other: ``D`` reads the first half
    and writes the second, ``Dᵀ`` the reverse, each bridge factor on its side.
    """
    out = dot("...tt,...tk->...tk", m, y)
    spec = "...ij,...ik->...jk" if transpose else "...ij,...jk->...ik"
    read = 1 if transpose else 0
    for b, (rows, cols) in zip(_levels(m.shape[-1]), bridges):
        inner, outer = (rows, cols) if transpose else (cols, rows)
        part = outer * dot(spec, _lower_blocks(m, b), _halves(y, b)[..., read, :, :] * inner)
        halves = [(jnp.zeros_like(part) if h == read else part)[..., None, :, :] for h in (0, 1)]
        out = out + jnp.concatenate(halves, axis=-3).reshape(out.shape)
    return out


def _merge(blocks: jax.Array, corner: jax.Array, n: int, b: int) -> jax.Array:
    """Diagonal blocks [..., 2n, b, b] and lower corners [..., n, b, b] -> [..., n, 2b, 2b]."""
    pairs = blocks.reshape(*blocks.shape[:-3], n, 2, b, b)
    first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
    top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([corner, second], axis=-1)], axis=-2)


def dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
