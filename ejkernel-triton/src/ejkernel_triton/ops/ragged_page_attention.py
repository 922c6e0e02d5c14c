"""ragged_page_attention in Triton: mixed prefill and decode, through the unified kernel.

The op is :func:`ejkernel_triton.ops.unified_attention.paged_attention` with its traced
``num_seqs`` (rows past it are not live: their tokens are zeros), causal, no ALiBi.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel_triton.ops.unified_attention import paged_attention
from ejkernel_triton.ops.unified_attention_config import (
    UnifiedAttentionConfig,
    selection,
    table_problem,
)

__all__ = [
    "RaggedPageAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_page_attention_triton",
    "supports",
]


@attrs.frozen(kw_only=True)
class RaggedPageAttentionConfig(UnifiedAttentionConfig):
    """Tunables of the Triton ragged page attention (:class:`UnifiedAttentionConfig`'s)."""


heuristic, config_space, supports = selection(
    RaggedPageAttentionConfig, table_problem("queries"), "queries"
)


def ragged_page_attention_triton(
    *, cfg: RaggedPageAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Mixed prefill and decode attention over a paged cache.

    Args:
        cfg: blocks, warps, stages, splits; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_page_attention`'s arguments by name, as its spec
            validated them (``num_seqs`` an int32 scalar array).

    Returns:
        [T, Hq, D] in the query dtype.
    """
    return paged_attention(cfg, args)
