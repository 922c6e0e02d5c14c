"""unified_attention on XLA: vLLM-style packed prefill and decode over a paged cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` (every sequence live) with the
ALiBi bias ``slope · (key_pos - query_pos)`` added after the soft cap and an optional
non-causal mode (a query then sees its sequence's keys up to ``kv_len``, or up to ``p + right``
with a sliding window). Under ``jax.jit`` the work follows the visible keys, never
``num_pages`` or the table width; table slots past a sequence's live pages are never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import attrs
import jax

from ejkernel_xla.ops import _paged as engine

__all__ = [
    "UnifiedAttentionConfig",
    "config_space",
    "heuristic",
    "unified_attention_xla",
]


@attrs.frozen(kw_only=True)
class UnifiedAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA unified attention (see :class:`~ejkernel_xla.ops._paged.PagedConfig`)."""


heuristic, config_space = engine.tuning(UnifiedAttentionConfig, engine.packed_problem)


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
    """Unified paged attention (arguments as validated by the core spec; OPS.md names).

    Args:
        queries: [T, Hq, D].
        key_cache, value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int; block_tables: [num_seqs, max_pages] int;
            query_start_loc: [num_seqs + 1] int.
        alibi_slopes: [Hq] or ``None``; softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        softmax_scale, causal, sliding_window, logits_soft_cap: as the spec normalises them.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [T, Hq, D] in the query dtype.
    """
    problem = engine.packed_problem(locals())
    st = engine.make_statics(
        problem, cfg, softmax_scale, logits_soft_cap, sliding_window, causal=causal
    )
    return engine.packed_forward(locals(), st)
