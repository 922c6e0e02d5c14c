"""The chunked gated delta rule on XLA: chunk layout and the forward and backward passes.

The engine of :mod:`ejkernel_xla.ops.kernel_delta_attention` (whose docstring gives the
algorithm): the streamed forward, the all-chunks-at-once form (packed sequences and the
backward) and the backward by recomputation; the chunk math is in ``_delta_intra``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.specs.kernel_delta_attention import L2NORM_EPS
from ejkernel_xla.ops._chunk_numerics import floor_gate
from ejkernel_xla.ops._chunked_layout import pad_axis
from ejkernel_xla.ops._delta_intra import Chunk, Prepared, dot, recurrence, ut_transform

__all__ = ["Statics", "backward", "forward"]


@attrs.frozen(kw_only=True)
class Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    chunk: int
    scale: float
    l2norm: bool


# --------------------------------------------------------------------------------------------
# Chunk layout: [B, S, H, ...] <-> [M, B, H, C, ...] (dense, or packed sequences)
# --------------------------------------------------------------------------------------------


class _Packed(NamedTuple):
    """Where each chunk slot's tokens come from when sequences are packed (B == 1)."""

    token: jax.Array  # [M, C] token index, S for a padding position
    seq: jax.Array  # [M] sequence owning the slot (clipped for unused slots)
    first: jax.Array  # [M] the slot starts its sequence: load its initial state
    last: jax.Array  # [M] the slot ends its sequence: record its final state
    slot_of_token: jax.Array  # [S]
    pos_of_token: jax.Array  # [S]
    inside: jax.Array  # [S] the token belongs to a sequence (else its output is zero)


def _num_slots(s: int, n: int, c: int) -> int:
    """Chunk slots enough for any split of S tokens into N sequences: Σ ceil(L_n / C)."""
    return max(1, (s + n * (c - 1)) // c)


def _packed_layout(cu_seqlens: jax.Array, s: int, c: int) -> _Packed:
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    m = _num_slots(s, n, c)
    lengths = cu[1:] - cu[:-1]
    chunks = (lengths + c - 1) // c
    ends = jnp.cumsum(chunks)
    starts = ends - chunks
    slot = jnp.arange(m, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), n - 1).astype(jnp.int32)
    used = slot < ends[-1]
    index = slot - starts[seq]
    valid = jnp.where(used, jnp.clip(lengths[seq] - index * c, 0, c), 0)
    pos = jnp.arange(c, dtype=jnp.int32)
    token = jnp.where(pos < valid[:, None], (cu[seq] + index * c)[:, None] + pos, s)
    t = jnp.arange(s, dtype=jnp.int32)
    seq_t = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), n - 1)
    offset = t - cu[seq_t]
    return _Packed(
        token=token,
        seq=seq,
        first=used & (index == 0),
        last=used & (index == chunks[seq] - 1),
        slot_of_token=starts[seq_t] + offset // c,
        pos_of_token=offset % c,
        inside=(t >= cu[0]) & (t < cu[-1]),
    )


def _to_chunks(x: jax.Array, c: int, packed: _Packed | None) -> jax.Array:
    """[B, S, H, *F] -> [M, B, H, C, *F], padding positions zero."""
    b, s = x.shape[:2]
    if packed is None:
        m = -(-s // c)
        x = jnp.pad(x, [(0, 0), (0, m * c - s)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, m, c, *x.shape[2:])
        return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2))
    rows = jnp.concatenate([x[0], jnp.zeros((1, *x.shape[2:]), x.dtype)])  # row S: padding
    x = rows[packed.token]  # [M, C, H, *F]
    return jnp.moveaxis(x, (0, 1, 2), (0, 2, 1))[:, None]


def _from_chunks(x: jax.Array, s: int, packed: _Packed | None) -> jax.Array:
    """[M, B, H, C, F] -> [B, S, H, F] (the inverse of :func:`_to_chunks` on real tokens)."""
    m, b, h, c, f = x.shape
    if packed is None:
        x = jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2)).reshape(b, m * c, h, f)
        return x[:, :s]
    x = jnp.moveaxis(x[:, 0], 1, 2)  # [M, C, H, F]
    x = x[jnp.clip(packed.slot_of_token, 0, m - 1), packed.pos_of_token]
    return jnp.where(packed.inside[:, None, None], x, 0.0)[None]


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("st", "return_state"))
def forward(
    arrays: dict[str, Any], st: Statics, return_state: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``(out [B, S, H, V], final_state or None)``: the streaming form unless sequences are
    packed."""
    if arrays["cu_seqlens"] is None and arrays["query"].shape[1] > 0:
        return _streamed(arrays, st, return_state)
    return _chunked(arrays, st)


def _streamed(
    arrays: dict[str, Any], st: Statics, return_state: bool
) -> tuple[jax.Array, jax.Array | None]:
    """The forward as one ``lax.scan`` over the B·N (batch row, chunk) pairs, batch-major.

    Each step reads one chunk of one batch row, all H heads, straight from the input layout
    ([B, S, H, F] viewed as [B·N, C, H, F]: no transpose or normalisation pass over the whole
    inputs), and while it is in cache normalises q and k, builds the chunk's UT transform
    ([H, C, C] products, the triangular inverse, ``W`` and ``Ũ``) and runs the recurrence on
    the carried [H, K, V] state of that row (reset at the row's first chunk). Only the outputs
    leave the loop (and the final states with ``return_state``); the all-chunks-at-once form
    (:func:`_chunked`) builds every chunk's factors first, [S / C, B, H, C, C + 2K + V] floats
    streamed through memory, and stays the packed-sequence path and the backward's.
    """
    f32 = lambda x: x.astype(jnp.float32)
    query = arrays["query"]
    b, s, h, dk = query.shape
    dv = arrays["value"].shape[-1]
    c = st.chunk
    n = -(-s // c)
    # Zero padding is neutral tokens: q = k = v = β = g = 0.
    rows = lambda x: pad_axis(x, 1, n * c).reshape(b * n, c, *x.shape[2:])
    inits = _initial_states(arrays)
    heads = lambda x: jnp.swapaxes(x, 0, 1)  # [C, H, ...] -> [H, C, ...] (in cache)

    def step(carry: Any, xs: Any) -> tuple[Any, jax.Array]:
        state, finals = carry
        q, k, v, beta, g, i = xs
        row = i // n
        start = lax.dynamic_index_in_dim(inits, row, axis=0, keepdims=False)
        state = jnp.where(i % n == 0, start, state)
        q, k = f32(q), f32(k)
        if st.l2norm:
            q, k = _l2_normalize(q), _l2_normalize(k)
        g = floor_gate(g)  # -inf (a state reset) floored here, not in a pass of its own
        chunk = Chunk(
            q=heads(q * st.scale), k=heads(k), v=heads(f32(v)), beta=heads(beta), g=heads(g)
        )
        out, new = recurrence(ut_transform(chunk, st, factor=True), state)
        if finals is not None:
            keep = lax.dynamic_index_in_dim(finals, row, axis=0, keepdims=False)
            finals = lax.dynamic_update_index_in_dim(
                finals, jnp.where(i % n == n - 1, new, keep), row, axis=0
            )
        return (new, finals), heads(out)

    finals = jnp.zeros((b, h, dk, dv), jnp.float32) if return_state else None
    carry = (jnp.zeros((h, dk, dv), jnp.float32), finals)
    xs = (
        rows(query),
        rows(arrays["key"]),
        rows(arrays["value"]),
        rows(f32(arrays["beta"])),
        rows(f32(arrays["g"])),
        jnp.arange(b * n, dtype=jnp.int32),
    )
    (_, finals), out = lax.scan(step, carry, xs)
    out = out.reshape(b, n * c, h, dv)[:, :s].astype(query.dtype)
    return out, finals


@functools.partial(jax.jit, static_argnames="st")
def backward(
    arrays: dict[str, Any], d_o: jax.Array, d_final: jax.Array | None, st: Statics
) -> dict[str, jax.Array | None]:
    """Recompute the chunked forward and pull the cotangents back through it."""
    names = ["query", "key", "value", "beta", "g"]
    if arrays["initial_state"] is not None:
        names.append("initial_state")
    diff = {n: arrays[n] for n in names}
    (_, final), pull_back = jax.vjp(lambda a: _chunked({**arrays, **a}, st), diff)
    d_final = jnp.zeros_like(final) if d_final is None else d_final.astype(final.dtype)
    (grads,) = pull_back((d_o.astype(arrays["query"].dtype), d_final))
    return {"initial_state": None, **grads}


def _chunked(arrays: dict[str, Any], st: Statics) -> tuple[jax.Array, jax.Array]:
    """The whole chunked algorithm: the UT transform of every chunk at once, then the
    inter-chunk recurrence and each chunk's output as a scan over chunks."""
    query = arrays["query"]
    s = query.shape[1]
    cu = arrays["cu_seqlens"]
    packed = None if cu is None else _packed_layout(cu, s, st.chunk)
    p = ut_transform(_prepare(arrays, st, packed), st)
    inits = _initial_states(arrays)
    if packed is None:

        def body(state: jax.Array, x: Prepared) -> tuple[jax.Array, jax.Array]:
            out, new = recurrence(x, state)
            return new, out

        final, out = lax.scan(body, inits, p)
    else:

        def packed_body(carry: Any, x: Any) -> tuple[Any, Any]:
            state, finals = carry
            x, seq, first, last = x
            state = jnp.where(first, inits[seq][None], state)  # a sequence starts afresh
            out, new = recurrence(x, state)
            finals = finals.at[seq].set(jnp.where(last, new[0], finals[seq]))
            return (new, finals), out

        carry = (inits[:1], inits)  # empty sequences keep their initial state
        (_, final), out = lax.scan(packed_body, carry, (p, packed.seq, packed.first, packed.last))
    return _from_chunks(out, s, packed).astype(query.dtype), final


def _prepare(arrays: dict[str, Any], st: Statics, packed: _Packed | None) -> Chunk:
    """Normalise, scale, cast to float32 and lay the inputs out in chunks ``[M, B, H, C, ...]``."""
    f32 = lambda x: x.astype(jnp.float32)
    q, k = f32(arrays["query"]), f32(arrays["key"])
    if st.l2norm:
        q, k = _l2_normalize(q), _l2_normalize(k)
    q = q * st.scale
    to = lambda x: _to_chunks(x, st.chunk, packed)
    beta = to(f32(arrays["beta"])[..., None])[..., 0]
    g = floor_gate(f32(arrays["g"]))  # -inf (a state reset) floored: see _chunk_numerics
    g = to(g) if g.ndim == 4 else to(g[..., None])[..., 0]
    return Chunk(q=to(q), k=to(k), v=to(f32(arrays["value"])), beta=beta, g=g)


def _l2_normalize(x: jax.Array) -> jax.Array:
    """The spec's ``x / sqrt(Σ x² + eps)``; the sum of squares as a dot, which XLA on CPU runs
    far faster than a fused multiply-reduce."""
    return x * lax.rsqrt(dot("...k,...k->...", x, x)[..., None] + L2NORM_EPS)


def _initial_states(arrays: dict[str, Any]) -> jax.Array:
    """[B or N, H, K, V] float32 (zeros when not given)."""
    init = arrays["initial_state"]
    if init is not None:
        return init.astype(jnp.float32)
    q, v = arrays["query"], arrays["value"]
    cu = arrays["cu_seqlens"]
    n = q.shape[0] if cu is None else cu.shape[0] - 1
    return jnp.zeros((n, q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
