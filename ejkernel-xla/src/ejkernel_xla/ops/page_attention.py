"""page_attention on XLA: one decode query per sequence, over a paged cache (forward only).

Runs the work-list core of :mod:`ejkernel_xla.ops.ragged_page_attention` with one work item per
sequence (a query block of one token, the query at position ``kv_len - 1``) and the paged key
fetch, so under ``jax.jit`` the work is ``Σ ceil(kv_len / kv_blocksize)`` key blocks (a sliding
window bounds it by the window): it grows with ``sum(kv_lens)``, never with ``num_pages`` or
the table width. Table slots past a sequence's live pages are never read.

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
)

__all__ = ["PageAttentionConfig", "config_space", "heuristic", "page_attention_xla"]


@attrs.frozen(kw_only=True)
class PageAttentionConfig(RaggedPageAttentionConfig):
    """Tunables of the XLA page attention: those of the ragged op (``q_blocksize`` is moot)."""


def _problem(query: Any, key_cache: Any, block_tables: Any) -> Problem:
    s = int(query.shape[0])
    page_size = int(key_cache.shape[1])
    return Problem(
        tokens=s,
        seqs=s,
        hq=int(query.shape[1]),
        kv_width=2 * int(key_cache.shape[2] * key_cache.shape[3]),
        page_size=page_size,
        capacity=int(block_tables.shape[1]) * page_size,
        decode=True,
    )


def heuristic(inv: Any) -> PageAttentionConfig:
    """One-token query blocks, ~256-key blocks, a step budget per backend."""
    kw = inv.kwargs
    return paged_heuristic(
        _problem(kw["query"], kw["key_cache"], kw["block_tables"]), PageAttentionConfig
    )


def config_space(inv: Any) -> list[PageAttentionConfig]:
    kw = inv.kwargs
    return paged_config_space(
        _problem(kw["query"], kw["key_cache"], kw["block_tables"]), PageAttentionConfig
    )


def page_attention_xla(
    *,
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: tuple[int, int] | None = None,
    cfg: PageAttentionConfig | None = None,
) -> jax.Array:
    """Decode attention over a paged cache (arguments as validated by the core spec).

    Args:
        query: [S, Hq, D].
        key_cache: [num_pages, page_size, Hkv, D].
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [S] int.
        block_tables: [S, max_pages] int.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before masking, or ``None``.
        sliding_window: ``(left, right)`` or ``None``.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [S, Hq, D] in the query dtype.
    """
    st = make_statics(
        _problem(query, key_cache, block_tables),
        cfg,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        causal=True,
        d=int(query.shape[-1]),
    )
    return _forward(query, key_cache, value_cache, kv_lens, block_tables, st)


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    st: Statics,
) -> jax.Array:
    s = query.shape[0]
    kv_len = kv_lens.astype(jnp.int32)
    capacity = block_tables.shape[1] * key_cache.shape[1]
    kv_hi = jnp.clip(kv_len, 0, capacity)
    seqs = Sequences(
        q_begin=jnp.arange(s, dtype=jnp.int32),
        q_len=jnp.ones((s,), jnp.int32),
        q_pos0=kv_len - 1,  # the decode token is the newest one
        kv_lo=jnp.zeros_like(kv_len),
        kv_hi=kv_hi,
    )
    return attend(
        query, seqs, paged_fetch(key_cache, value_cache, block_tables, kv_hi, st.kv_block), st
    )
