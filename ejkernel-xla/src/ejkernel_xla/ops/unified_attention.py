"""unified_attention on XLA: vLLM-style packed prefill and decode over a paged cache (forward only).

Runs the work-list core of :mod:`ejkernel_xla.ops.ragged_page_attention` (every sequence live)
with the ALiBi bias ``slope · (key_pos - query_pos)`` added after the soft cap and an optional
non-causal mode (a query then sees its sequence's keys up to ``kv_len``, or up to ``p + right``
with a sliding window). Under ``jax.jit`` the work follows the visible keys, never
``num_pages`` or the table width; table slots past a sequence's live pages are never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel_xla.ops.ragged_page_attention import (
    Problem,
    RaggedPageAttentionConfig,
    make_statics,
    paged_config_space,
    paged_heuristic,
    ragged_forward,
)

__all__ = [
    "UnifiedAttentionConfig",
    "config_space",
    "heuristic",
    "unified_attention_xla",
]


@attrs.frozen(kw_only=True)
class UnifiedAttentionConfig(RaggedPageAttentionConfig):
    """Tunables of the XLA unified attention: those of the ragged op."""


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


def heuristic(inv: Any) -> UnifiedAttentionConfig:
    """Query blocks of the largest power of two with ``S · (bq - 1) <= T`` (capped per
    backend), ~256-key blocks of whole pages, pairs per step from the backend's step budget."""
    kw = inv.kwargs
    return paged_heuristic(
        _problem(kw["queries"], kw["key_cache"], kw["block_tables"]), UnifiedAttentionConfig
    )


def config_space(inv: Any) -> list[UnifiedAttentionConfig]:
    kw = inv.kwargs
    return paged_config_space(
        _problem(kw["queries"], kw["key_cache"], kw["block_tables"]), UnifiedAttentionConfig
    )


def unified_attention_xla(
    *,
    queries: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    alibi_slopes: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    cfg: UnifiedAttentionConfig | None = None,
) -> jax.Array:
    """Unified paged attention (arguments as validated by the core spec).

    Args:
        queries: [T, Hq, D].
        key_cache: [num_pages, page_size, Hkv, D].
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int.
        block_tables: [num_seqs, max_pages] int.
        query_start_loc: [num_seqs + 1] int.
        alibi_slopes: [Hq] or ``None``.
        softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        causal: keys at positions <= the query's only.
        sliding_window: ``(left, right)`` or ``None``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before ALiBi and masking, or ``None``.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [T, Hq, D] in the query dtype.
    """
    st = make_statics(
        _problem(queries, key_cache, block_tables),
        cfg,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        causal=causal,
        d=int(queries.shape[-1]),
    )
    num_seqs = jax.numpy.int32(kv_lens.shape[0])
    return ragged_forward(
        queries,
        key_cache,
        value_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        softmax_aux,
        alibi_slopes,
        st,
    )
