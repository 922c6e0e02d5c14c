"""ragged_page_attention on XLA: mixed prefill and decode over a paged KV cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` (FlashAttention-2's online softmax
over (work item, key block) pairs): each live sequence's queries, its last tokens, are cut
into work items of ``q_blocksize`` tokens, each paired with the key blocks (whole pages) it
can see causally and within the sliding window. Under ``jax.jit`` the work follows the visible
keys, never ``num_pages`` or the table width; table slots past a sequence's live pages are
never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import attrs
import jax

from ejkernel_xla.ops import _paged as engine

__all__ = [
    "RaggedPageAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_page_attention_xla",
]


@attrs.frozen(kw_only=True)
class RaggedPageAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA ragged paged attention (see
    :class:`~ejkernel_xla.ops._paged.PagedConfig`)."""


heuristic, config_space = engine.tuning(RaggedPageAttentionConfig, engine.packed_problem)


def ragged_page_attention_xla(
    *,
    queries: jax.Array,
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
    cfg: RaggedPageAttentionConfig | None = None,
) -> jax.Array:
    """Ragged paged attention (arguments as validated by the core spec; OPS.md names).

    Args:
        queries: [T, Hq, D].
        key_cache, value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int; block_tables: [num_seqs, max_pages] int;
            query_start_loc: [num_seqs + 1] int; num_seqs: int32 scalar, the live sequences.
        softmax_scale, logits_soft_cap, sliding_window: as the spec normalises them.
        softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [T, Hq, D] in the query dtype.
    """
    st = engine.make_statics(
        engine.packed_problem(locals()), cfg, softmax_scale, logits_soft_cap, sliding_window
    )
    return engine.packed_forward(locals(), st)
