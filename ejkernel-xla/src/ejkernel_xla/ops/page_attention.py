"""page_attention on XLA: one decode query per sequence, over a paged cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` with one work item per sequence (a
query block of one token, the query at position ``kv_len - 1``) and the paged key fetch, so
under ``jax.jit`` the work is ``Σ ceil(kv_len / kv_blocksize)`` key blocks (a sliding window
bounds it by the window): it grows with ``sum(kv_lens)``, never with ``num_pages`` or the table
width. Table slots past a sequence's live pages are never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_xla.ops import _paged as engine

__all__ = ["PageAttentionConfig", "config_space", "heuristic", "page_attention_xla"]


@attrs.frozen(kw_only=True)
class PageAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA page attention (see :class:`~ejkernel_xla.ops._paged.PagedConfig`;
    ``q_blocksize`` is moot: one query per sequence)."""


def _problem(kw: Mapping[str, Any]) -> engine.Problem:
    return engine.paged_problem(kw["query"], kw["key_cache"], kw["block_tables"], decode=True)


heuristic, config_space = engine.tuning(PageAttentionConfig, _problem)


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
        key_cache, value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [S] int; block_tables: [S, max_pages] int.
        softmax_scale, logits_soft_cap, sliding_window: as the spec normalises them.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [S, Hq, D] in the query dtype.
    """
    st = engine.make_statics(
        _problem(locals()), cfg, softmax_scale, logits_soft_cap, sliding_window
    )
    return _forward(query, key_cache, value_cache, kv_lens, block_tables, st)


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    st: engine.Statics,
) -> jax.Array:
    kv_len = kv_lens.astype(jnp.int32)
    kv_hi = jnp.clip(kv_len, 0, block_tables.shape[1] * key_cache.shape[1])
    # The decode token is the newest one.
    seqs = engine.decode_sequences(kv_len - 1, jnp.zeros_like(kv_len), kv_hi)
    return engine.attend(
        query,
        seqs,
        engine.paged_fetch(key_cache, value_cache, block_tables, kv_hi, st.kv_block),
        st,
    )
