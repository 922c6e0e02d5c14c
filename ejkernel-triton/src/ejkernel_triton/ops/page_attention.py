"""page_attention in Triton: one decode query per sequence, through the unified kernel.

Sequence ``s`` is a packed batch's sequence of one token (``query_start_loc = arange(S + 1)``,
every row live), at position ``kv_lens[s] - 1``: :func:`ejkernel_triton.ops.unified_attention.
paged_attention` runs it in its decode mode (one program per sequence and KV head, no search
for the sequence), split-K where the batch does not fill the GPU. It ranks above the CUDA
plugin's native decode unless a shipped table measured that faster.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_triton.ops.unified_attention import paged_attention
from ejkernel_triton.ops.unified_attention_config import (
    UnifiedAttentionConfig,
    selection,
    table_problem,
)

__all__ = ["PageAttentionConfig", "config_space", "heuristic", "page_attention_triton", "supports"]


@attrs.frozen(kw_only=True)
class PageAttentionConfig(UnifiedAttentionConfig):
    """Tunables of the Triton page attention (:class:`UnifiedAttentionConfig`'s)."""


heuristic, config_space, supports = selection(PageAttentionConfig, table_problem("query"), "query")


def page_attention_triton(*, cfg: PageAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Decode attention over a paged cache.

    Args:
        cfg: blocks, warps, stages, splits; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.page_attention`'s arguments by name, as its spec validated
            them.

    Returns:
        [S, Hq, D] in the query dtype; sequences with ``kv_len == 0`` give zeros.
    """
    s = args["query"].shape[0]
    # Each sequence is one packed token, its query.
    packed = {
        **args,
        "queries": args["query"],
        "query_start_loc": jnp.arange(s + 1, dtype=jnp.int32),
        "num_seqs": s,
    }
    return paged_attention(cfg, packed, decode=True)
