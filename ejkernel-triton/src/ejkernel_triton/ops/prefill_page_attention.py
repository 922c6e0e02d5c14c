"""prefill_page_attention in Triton: one sequence's causal chunk, through the unified kernel.

The chunk is a packed batch of one sequence (``query_start_loc = [0, C]``, the table
``page_indices[None]``, ``kv_lens = [kv_len]``) for
:func:`ejkernel_triton.ops.unified_attention.paged_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_triton.ops.unified_attention import paged_attention
from ejkernel_triton.ops.unified_attention_config import (
    Problem,
    UnifiedAttentionConfig,
    selection,
)

__all__ = [
    "PrefillPageAttentionConfig",
    "config_space",
    "heuristic",
    "prefill_page_attention_triton",
    "supports",
]


@attrs.frozen(kw_only=True)
class PrefillPageAttentionConfig(UnifiedAttentionConfig):
    """Tunables of the Triton prefill page attention (:class:`UnifiedAttentionConfig`'s)."""


def _problem(kw: Mapping[str, Any]) -> Problem:
    return Problem.of(kw["query"], kw["key_cache"], 1, kw["page_indices"].shape[0])


heuristic, config_space, supports = selection(PrefillPageAttentionConfig, _problem, "query")


def prefill_page_attention_triton(
    *, cfg: PrefillPageAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Causal attention of one sequence's prefill chunk over its pages.

    Args:
        cfg: blocks, warps, stages, splits; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.prefill_page_attention`'s arguments by name, as its spec
            validated them (``kv_len`` an int32 scalar array).

    Returns:
        [C, Hq, D] in the query dtype; queries at negative positions give zeros.
    """
    query = args["query"]
    # A packed batch of one sequence.
    packed = {
        **args,
        "queries": query,
        "kv_lens": jnp.asarray(args["kv_len"], jnp.int32).reshape(1),
        "block_tables": args["page_indices"][None],
        "query_start_loc": jnp.asarray([0, query.shape[0]], jnp.int32),
        "num_seqs": 1,
    }
    return paged_attention(cfg, packed)
