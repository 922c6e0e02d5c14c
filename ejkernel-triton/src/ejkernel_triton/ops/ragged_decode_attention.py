"""ragged_decode_attention in Triton: one decode query per row of a dense cache, through the
unified kernel.

A dense cache ``[B, Sk, Hkv, D]`` is a paged cache of ``B`` pages of ``Sk`` slots, row ``b``
its page ``b`` (the table is ``arange(B)[:, None]``; no copy of the cache): row ``b`` is a
sequence of ``kv_len = end`` keys whose one query sits at ``end - 1``, and ``sequence_start``
bounds its keys from below. :func:`ejkernel_triton.ops.unified_attention.paged_attention`
runs it in its decode mode (one program per row and KV head; split-K where the batch does not
fill the GPU). It ranks above the CUDA plugin's native decode unless a shipped table measured
that faster.
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
    "RaggedDecodeAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_decode_attention_triton",
    "supports",
]


@attrs.frozen(kw_only=True)
class RaggedDecodeAttentionConfig(UnifiedAttentionConfig):
    """Tunables of the Triton ragged decode (:class:`UnifiedAttentionConfig`'s)."""


def _problem(kw: Mapping[str, Any]) -> Problem:
    return Problem.of(kw["query"], kw["key"], kw["query"].shape[0], 1)


heuristic, config_space, supports = selection(
    RaggedDecodeAttentionConfig, _problem, "query", caches=("key", "value")
)


def ragged_decode_attention_triton(
    *, cfg: RaggedDecodeAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Decode attention over ``[start, end)`` of each row of a dense cache.

    Args:
        cfg: blocks, warps, stages, splits; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_decode_attention`'s arguments by name, as its spec
            validated them.

    Returns:
        [B, Hq, Dv] in the query dtype; empty ranges give zeros.
    """
    query, key = args["query"], args["key"]
    b, sk = int(key.shape[0]), int(key.shape[1])
    end = jnp.clip(args["sequence_end"].astype(jnp.int32), 0, sk)
    start = jnp.clip(args["sequence_start"].astype(jnp.int32), 0, sk)
    window = args.get("sliding_window")
    if isinstance(window, int):
        window = (window, window)
    # Row b is page b of a paged cache, one sequence of `end` keys whose query is its last.
    packed = {
        **args,
        "queries": query,
        "key_cache": key,
        "value_cache": args["value"],
        "kv_lens": end,
        "block_tables": jnp.arange(b, dtype=jnp.int32)[:, None],
        "query_start_loc": jnp.arange(b + 1, dtype=jnp.int32),
        "num_seqs": b,
        "sliding_window": window,
    }
    return paged_attention(cfg, packed, decode=True, kv_starts=start)
