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
    passed_through,
    serving_supports,
    table_problem,
    tuning,
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


heuristic, config_space = tuning(RaggedPageAttentionConfig, table_problem("queries"))


def supports(inv: Any) -> bool | str:
    """True, or why not (dtypes, head dims over 256)."""
    return serving_supports(inv.kwargs, "queries")


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
    names = ("queries", "key_cache", "value_cache", "kv_lens", "block_tables")
    return paged_attention(
        cfg,
        **{n: args[n] for n in names},
        query_start_loc=args["query_start_loc"],
        num_seqs=args["num_seqs"],
        **passed_through(args),
        softmax_aux=args.get("softmax_aux"),
    )
