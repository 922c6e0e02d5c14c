"""Inside chunks, for the chunked linear-attention engine (:mod:`ejkernel_xla.ops._chunked`).

Every array is [M, C, F], one row per (chunk, batch, head): the cumulative log gates, each
chunk's local terms, and the intra-chunk output in its three exact forms (scalar gate,
factored, two-level "exact"), described in that module's docstring.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel_xla.ops._chunk_numerics import finite_part, poison
from ejkernel_xla.ops._chunked_layout import pad_axis

if TYPE_CHECKING:
    from ejkernel_xla.ops._chunked import LinearStatics

__all__ = [
    "FACTORED_RANGE",
    "causal",
    "chunk_output",
    "cumulate",
    "decay",
    "decays",
    "dot",
    "factorable",
    "local_terms",
]


#: Largest range of the cumulative log gates inside a chunk (the chunk start, 0, included) for
#: which the factored form runs: its factors stay within exp(±80) and so do the products of any
#: pair, short of float32's overflow (exp(88.7)) and of its subnormals (exp(-87.3)).
FACTORED_RANGE = 80.0
#: Tokens per block of the two-level cumulative sum of the gates.
_CUMSUM_BLOCK = 8
#: Pairwise-decay elements (float32) the exact path materialises per group of chunk rows.
_EXACT_GROUP_ELEMENTS = 1 << 18


def cumulate(g: jax.Array | None) -> jax.Array | None:
    """Cumulative log gates from the chunk start (inclusive), [M, C, F].

    Two levels of XLA's cumulative sum (inside blocks of 8 tokens, then across blocks), which
    is several times faster on CPU than one over the chunk and as accurate: every sum is the
    previous one plus one gate, rounded once, so ``b_t - b_s`` for nearby tokens keeps its
    digits even for large gates (a tree-shaped scan loses them).
    """
    if g is None:
        return None
    m, c, f = g.shape
    if c % _CUMSUM_BLOCK or c <= _CUMSUM_BLOCK:
        return jnp.cumsum(g, axis=1)
    inside = jnp.cumsum(g.reshape(m, c // _CUMSUM_BLOCK, _CUMSUM_BLOCK, f), axis=2)
    totals = jnp.cumsum(inside[:, :, -1], axis=1)
    before = jnp.concatenate([jnp.zeros_like(totals[:, :1]), totals[:, :-1]], axis=1)
    return (before[:, :, None] + inside).reshape(m, c, f)


def decays(b: jax.Array | None) -> jax.Array | None:
    """Whole-chunk decay ``exp(b_last)``, [M, F]."""
    return None if b is None else jnp.exp(b[:, -1])


def decay(h: jax.Array, dk: jax.Array | None, dv: jax.Array | None) -> jax.Array:
    """``h ⊙ dk[:, None] ⊙ dv[None, :]`` for states [..., K, V] (absent factors are 1)."""
    if dk is not None:
        h = h * dk[..., :, None]
    if dv is not None:
        h = h * dv[..., None, :]
    return h


def local_terms(
    q: jax.Array, k: jax.Array, v: jax.Array, bk: jax.Array | None, bv: jax.Array | None
) -> tuple[Any, ...]:
    """What every chunk computes on its own, all with non-positive exponents for gates ≤ 0:

    ``q ⊙ exp(b)`` (reads the carried state), ``k ⊙ exp(b_last - b)`` and
    ``v ⊙ exp(b^v_last - b^v)`` (enter the next state), the whole-chunk decays [M, F] and the
    chunk's own state ``U = Σ_s (k_s ⊙ exp(b_last - b_s))ᵀ (v_s ⊙ exp(b^v_last - b^v_s))``
    [M, K, V].
    """
    if bk is not None:
        q = q * jnp.exp(bk)
        k = k * jnp.exp(bk[:, -1:] - bk)
    if bv is not None:
        v = v * jnp.exp(bv[:, -1:] - bv)
    return q, k, v, decays(bk), decays(bv), dot("mck,mcv->mkv", k, v)


def factorable(bk: jax.Array | None, bv: jax.Array | None) -> jax.Array | None:
    """Whether every chunk's cumulative gates stay within ±:data:`FACTORED_RANGE` of each
    other and of the chunk start (a traced bool); ``None`` when there is nothing to choose
    (no gate over K or V)."""
    if bv is None and (bk is None or bk.shape[-1] == 1):
        return None  # the scalar path is exact and cheap
    spread = lambda b: jnp.max(
        jnp.maximum(jnp.max(b, axis=1), 0.0) - jnp.minimum(jnp.min(b, axis=1), 0.0)
    )
    spreads = [spread(b) for b in (bk, bv) if b is not None]
    return functools.reduce(jnp.maximum, spreads) <= FACTORED_RANGE


def chunk_output(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bk: jax.Array | None,
    bv: jax.Array | None,
    local: tuple[Any, ...],
    h_start: jax.Array,
    st: LinearStatics,
    mode: str,
) -> jax.Array:
    """Every chunk's output [M, C, V]: from the carried state, plus inside the chunk.

    The products inside the chunk take the values with non-finite entries zeroed, and the
    outputs from a chunk's first non-finite value on are NaN (per channel), so a NaN or inf
    reaches only its causal future (:mod:`ejkernel_xla.ops._chunk_numerics`).

    ``mode="factored"`` (every chunk's gates within :data:`FACTORED_RANGE`) splits each pair's
    decay at the chunk start, ``exp(b_t - b_s) = exp(b_t) · exp(-b_s)``, and reuses the local
    terms: the chunk is two matmuls. ``mode="exact"`` takes the two-level form, safe for any
    gates.
    """
    q_in, k_out, v_out = local[:3]
    inter = dot("mck,mkv->mcv", q_in, h_start)
    gate_v = None if bv is None else jnp.exp(bv)
    if bv is None and (bk is None or bk.shape[-1] == 1):
        v_in, first = finite_part(v)
        out = inter + _intra_scalar(q, k, v_in, bk)
    elif mode == "factored":
        # Within the factored range v_out = v ⊙ exp(b^v_last - b^v) is finite exactly where v is.
        k_f = k_out if bk is None else k_out * jnp.exp(-bk[:, -1:])
        v_f, first = finite_part(v_out)
        v_f = v_f if bv is None else v_f * jnp.exp(-bv[:, -1:])
        scores = jnp.where(causal(q.shape[1]), dot("mck,msk->mcs", q_in, k_f), 0.0)
        out = inter + dot("mcs,msv->mcv", scores, v_f)
        if gate_v is not None:
            out = out * gate_v
    else:
        v_in, first = finite_part(v)
        out = inter if gate_v is None else inter * gate_v
        out = out + _intra_exact(_Rows(q, k, v_in, bk, bv), st.sub_chunk)
    return poison(st.scale * out, first)


def causal(c: int) -> jax.Array:
    return jnp.tril(jnp.ones((c, c), bool))


def _intra_scalar(q: jax.Array, k: jax.Array, v: jax.Array, bk: jax.Array | None) -> jax.Array:
    """Per-head scalar gate: ``((q kᵀ) ⊙ exp(b_t - b_s) ⊙ [s ≤ t]) v`` per chunk (exact)."""
    return dot("mcs,msv->mcv", _scalar_scores(q, k, bk, causal(q.shape[1])), v)


def _scalar_scores(q: jax.Array, k: jax.Array, bk: jax.Array | None, mask: jax.Array) -> jax.Array:
    """``(q kᵀ) ⊙ exp(b_t - b_s)`` where ``mask`` holds, else 0, for no key gate or a per-head
    scalar one (``bk`` [M, C, 1]). The exponent is masked before ``exp`` (no overflow, no NaN
    gradient) and the product selected after it (a NaN key of a later token stays out)."""
    scores = dot("mck,msk->mcs", q, k)
    if bk is None:
        return jnp.where(mask, scores, 0.0)
    b = bk[..., 0]
    decay = jnp.exp(jnp.where(mask, b[:, :, None] - b[:, None, :], -jnp.inf))
    return jnp.where(mask, scores * decay, 0.0)


class _Rows(NamedTuple):
    """The operands of the exact form, [M, C, F] each: queries, keys, values and the
    cumulative key and value gates (``None`` when absent)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    bk: jax.Array | None
    bv: jax.Array | None


def _intra_exact(x: _Rows, sub: int) -> jax.Array:
    """:func:`_intra_subchunks` over groups of chunk rows, each group rematerialised in the
    backward: its pairwise [c, c, F] decays then never exist for more than one group at a
    time (and a compiled program holding this path as an untaken branch stays small)."""
    m, c, dv = x.v.shape
    rows = max(1, _EXACT_GROUP_ELEMENTS // (c * sub * max(x.q.shape[-1], dv)))
    if rows >= m:
        return _intra_subchunks(x, sub)
    groups = -(-m // rows)
    grouped = lambda a: (
        None if a is None else pad_axis(a, 0, groups * rows).reshape(groups, rows, *a.shape[1:])
    )
    body = jax.checkpoint(lambda xs: _intra_subchunks(xs, sub))
    out = lax.map(body, _Rows(*map(grouped, x)))
    return out.reshape(groups * rows, c, dv)[:m]


def _intra_subchunks(x: _Rows, sub: int) -> jax.Array:
    """Gates over K and/or V, any spread: the two-level form (see the module docstring).

    Arrays stay at most 4-D (XLA's CPU code for 5-D broadcasts is several times slower).
    """
    m, c, dv = x.v.shape
    n = c // sub
    out = jnp.zeros((m, n, sub, dv), jnp.float32)
    if n > 1:
        out = _intra_off_diagonal(x, sub)
    split = lambda a: None if a is None else a.reshape(m * n, sub, a.shape[-1])
    q2, k2, v2, bk2, bv2 = (split(a) for a in x)  # [M·n, c, F]
    tril = causal(sub)
    # Diagonal sub-chunks: pairwise decays exp(b_t - b_s), s ≤ t, [M·n, c, c, F].
    if bk2 is None or bk2.shape[-1] == 1:
        diag = _scalar_scores(q2, k2, bk2, tril)
    else:
        ek = jnp.where(tril[:, :, None], bk2[:, :, None, :] - bk2[:, None, :, :], -jnp.inf)
        diag = jnp.sum(q2[:, :, None, :] * k2[:, None, :, :] * jnp.exp(ek), axis=-1)
        diag = jnp.where(tril, diag, 0.0)  # a later token's NaN key times exp(-inf) = 0 is NaN
    if bv2 is None:
        out_diag = dot("mcs,msv->mcv", diag, v2)
    else:
        ev = jnp.where(tril[:, :, None], bv2[:, :, None, :] - bv2[:, None, :, :], -jnp.inf)
        out_diag = jnp.sum(diag[:, :, :, None] * jnp.exp(ev) * v2[:, None, :, :], axis=2)
    return (out + out_diag.reshape(m, n, sub, dv)).reshape(m, c, dv)


def _intra_off_diagonal(x: _Rows, sub: int) -> jax.Array:
    """Sub-chunk i against every earlier token of its chunk, [M, n, c, V], with decays split
    at ``r_i``, the cumulative gate at sub-chunk i's first token (flash-linear-attention's
    reference point): ``exp(b_t - r_i)`` for t in sub-chunk i and ``exp(r_i - b_s)`` for
    s before it are both ≤ 1."""
    q, k, v, bk, bv = x
    m, c, _ = v.shape
    n = c // sub
    before = (jnp.arange(c)[None, :] < (jnp.arange(n) * sub)[:, None])[
        None, :, :, None
    ]  # [1, n, C, 1]
    split = lambda a: a.reshape(m, n, sub, a.shape[-1])
    if bk is None:
        q_i = split(q)
        k_i = jnp.where(before, k[:, None], 0.0)
    else:
        r = split(bk)[:, :, :1]  # [M, n, 1, K]
        q_i = split(q) * jnp.exp(split(bk) - r)
        k_i = k[:, None] * jnp.exp(jnp.where(before, r - bk[:, None], -jnp.inf))  # [M, n, C, K]
        k_i = jnp.where(before, k_i, 0.0)  # a later token's NaN key times 0 is NaN
    scores = dot("mick,misk->mics", q_i, k_i)  # [M, n, c, C]
    if bv is None:
        return dot("mics,msv->micv", scores, v)
    r = split(bv)[:, :, :1]
    v_i = v[:, None] * jnp.exp(jnp.where(before, r - bv[:, None], -jnp.inf))
    return dot("mics,misv->micv", scores, v_i) * jnp.exp(split(bv) - r)


def dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
