"""ragged_page_attention_v3 on XLA: write the new keys/values into their pages, then attend.

The update is two scatters, ``cache.at[page, slot].set(new, mode="drop")``, of the ``T`` new
rows only (tokens that must not be written aim at page ``num_pages``, out of range, and are
dropped), followed by the work-list attention of :mod:`ejkernel_xla.ops.ragged_page_attention`
on the updated caches, in one jitted computation. Called under ``jax.jit`` with the caches
donated, XLA aliases the returned caches to the donated buffers and the update happens in
place (O(T) writes); the attention then gathers only the live pages, so the whole step never
touches memory in proportion to ``num_pages``.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_xla.ops.ragged_page_attention import (
    Problem,
    RaggedPageAttentionConfig,
    Sequences,
    Statics,
    attend,
    make_statics,
    paged_config_space,
    paged_fetch,
    paged_heuristic,
    paged_sequences,
)

__all__ = [
    "RaggedPageAttentionV3Config",
    "config_space",
    "heuristic",
    "ragged_page_attention_v3_xla",
]


@attrs.frozen(kw_only=True)
class RaggedPageAttentionV3Config(RaggedPageAttentionConfig):
    """Tunables of the XLA fused update and attention: those of the ragged op."""


def _problem(queries: Any, key_cache: Any, block_tables: Any) -> Problem:
    s, max_pages = block_tables.shape
    page_size = int(key_cache.shape[1])
    return Problem(
        tokens=int(queries.shape[0]),
        seqs=int(s),
        hq=int(queries.shape[1]),
        kv_width=2 * int(key_cache.shape[2] * key_cache.shape[3]),
        page_size=page_size,
        capacity=int(max_pages) * page_size,
        decode=False,
    )


def heuristic(inv: Any) -> RaggedPageAttentionV3Config:
    """Query blocks of the largest power of two with ``S · (bq - 1) <= T`` (capped per
    backend), ~256-key blocks of whole pages, pairs per step from the backend's step budget."""
    kw = inv.kwargs
    return paged_heuristic(
        _problem(kw["queries"], kw["key_cache"], kw["block_tables"]), RaggedPageAttentionV3Config
    )


def config_space(inv: Any) -> list[RaggedPageAttentionV3Config]:
    kw = inv.kwargs
    return paged_config_space(
        _problem(kw["queries"], kw["key_cache"], kw["block_tables"]), RaggedPageAttentionV3Config
    )


def ragged_page_attention_v3_xla(
    *,
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: tuple[int, int] | None = None,
    softmax_aux: jax.Array | None = None,
    cfg: RaggedPageAttentionV3Config | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fused cache update and ragged paged attention (arguments as validated by the core spec).

    Args:
        queries: [T, Hq, D].
        keys: [T, Hkv, D], written before attending.
        values: [T, Hkv, D].
        key_cache: [num_pages, page_size, Hkv, D]; donate it (``jax.jit(...,
            donate_argnums=...)``) for an in-place update.
        value_cache: [num_pages, page_size, Hkv, D]; likewise.
        kv_lens: [num_seqs] int, lengths after the update.
        block_tables: [num_seqs, max_pages] int.
        query_start_loc: [num_seqs + 1] int.
        num_seqs: int32 scalar, the live sequences.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before masking, or ``None``.
        sliding_window: ``(left, right)`` or ``None``.
        softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        ``(out [T, Hq, D], key_cache, value_cache)``.
    """
    st = make_statics(
        _problem(queries, key_cache, block_tables),
        cfg,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        causal=True,
        d=int(queries.shape[-1]),
    )
    return _forward(
        queries,
        keys,
        values,
        key_cache,
        value_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        softmax_aux,
        st,
    )


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    softmax_aux: jax.Array | None,
    st: Statics,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    t = queries.shape[0]
    capacity = block_tables.shape[1] * key_cache.shape[1]
    seqs = paged_sequences(kv_lens, query_start_loc, num_seqs, t, capacity)
    page, slot = _destinations(seqs, block_tables, key_cache.shape[0], key_cache.shape[1], t)
    key_cache = key_cache.at[page, slot].set(keys.astype(key_cache.dtype), mode="drop")
    value_cache = value_cache.at[page, slot].set(values.astype(value_cache.dtype), mode="drop")
    fetch = paged_fetch(key_cache, value_cache, block_tables, seqs.kv_hi, st.kv_block)
    out = attend(queries, seqs, fetch, st, softmax_aux=softmax_aux)
    return out, key_cache, value_cache


def _destinations(
    seqs: Sequences, block_tables: jax.Array, num_pages: int, page_size: int, tokens: int
) -> tuple[jax.Array, jax.Array]:
    """Page and slot of each new token; ``num_pages`` (dropped) for tokens not to be written."""
    t = jnp.arange(tokens, dtype=jnp.int32)
    s = block_tables.shape[0]
    seq = jnp.minimum(jnp.searchsorted(seqs.q_begin + seqs.q_len, t, side="right"), s - 1)
    i = t - seqs.q_begin[seq]
    position = seqs.q_pos0[seq] + i
    column = position // page_size
    live = (i >= 0) & (i < seqs.q_len[seq]) & (position >= 0) & (column < block_tables.shape[1])
    page = block_tables[seq, jnp.clip(column, 0, block_tables.shape[1] - 1)]
    live &= (page >= 0) & (page < num_pages)
    return jnp.where(live, page, num_pages), position % page_size
