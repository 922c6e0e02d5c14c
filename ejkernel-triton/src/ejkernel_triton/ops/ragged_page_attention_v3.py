"""ragged_page_attention_v3 in Triton: write the new tokens into their pages in place, then
ragged paged attention through the unified kernel.

The update is one small Triton kernel
(:func:`ejkernel_triton.kernels.paged_cache_update.write_tokens_kernel`) whose outputs alias
the caches (jax-triton's ``input_output_aliases``): it writes the ``T`` new rows and nothing
else. Under ``jax.jit`` with the caches donated the whole step holds one copy of each cache;
without donation XLA copies each cache once before the kernel (the caller's stay valid). With
``k_scale``/``v_scale`` the new rows are stored quantised
(:func:`ejkernel.attention_semantics.quantize_kv`, the ``[T, Hkv, D]`` rows only). The
attention is :mod:`ejkernel_triton.ops.ragged_page_attention`'s on the updated caches.

On the CPU interpreter the kernel runs in a host callback, which returns fresh buffers: the
aliasing, and so the in-place update, is the GPU path's.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import quantize_kv
from ejkernel.specs.ragged_page_attention_v3 import cache_destinations
from ejkernel_triton import _launch
from ejkernel_triton._launch import pow2
from ejkernel_triton.ops.ragged_page_attention import ragged_page_attention_triton
from ejkernel_triton.ops.unified_attention_config import (
    UnifiedAttentionConfig,
    selection,
    table_problem,
)

__all__ = [
    "RaggedPageAttentionV3Config",
    "config_space",
    "heuristic",
    "ragged_page_attention_v3_triton",
    "supports",
    "write_tokens",
]

#: Elements one program of the update copies.
_UPDATE_BLOCK = 1024


@attrs.frozen(kw_only=True)
class RaggedPageAttentionV3Config(UnifiedAttentionConfig):
    """Tunables of the Triton ragged page attention v3's attention
    (:class:`UnifiedAttentionConfig`'s; the update has none)."""


heuristic, config_space, supports = selection(
    RaggedPageAttentionV3Config, table_problem("queries"), "queries"
)


def write_tokens(
    key_cache: jax.Array,
    value_cache: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    dest: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The caches with row ``t`` of ``keys``/``values`` (``[T, Hkv, D]``, in the cache dtype)
    written at cache row ``dest[t]`` (skipped where ``-1``), the caches aliased to the
    outputs."""
    from ejkernel_triton.kernels.paged_cache_update import write_tokens_kernel

    t, hkv, d = (int(n) for n in keys.shape)
    if t == 0:
        return key_cache, value_cache
    row = hkv * d
    block = min(pow2(row), _UPDATE_BLOCK)
    key_cache, value_cache = _launch.launch(
        write_tokens_kernel,
        keys,
        values,
        key_cache,
        value_cache,
        dest.astype(jnp.int32),
        out_shape=[
            jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
            jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype),
        ],
        grid=(t, -(-row // block), 1),
        num_warps=4,
        num_stages=1,
        input_output_aliases={2: 0, 3: 1},
        ROW=row,
        BLOCK=block,
    )
    return key_cache, value_cache


def ragged_page_attention_v3_triton(
    *, cfg: RaggedPageAttentionV3Config | None = None, **args: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the new keys/values into their pages (in place), then ragged paged attention.

    Args:
        cfg: blocks, warps, stages, splits of the attention; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_page_attention_v3`'s arguments by name, as its spec
            validated them; donate ``key_cache`` and ``value_cache``
            (``jax.jit(..., donate_argnums=...)``) for an update without a copy.

    Returns:
        ``(out [T, Hq, D], key_cache, value_cache)``.
    """
    key_cache, value_cache = args["key_cache"], args["value_cache"]
    k_scale, v_scale = args.get("k_scale"), args.get("v_scale")
    num_pages, page_size = (int(n) for n in key_cache.shape[:2])
    tables = (args["kv_lens"], args["block_tables"], args["query_start_loc"], args["num_seqs"])
    dest = cache_destinations(*tables, args["queries"].shape[0], num_pages, page_size)
    key_cache, value_cache = write_tokens(
        key_cache,
        value_cache,
        quantize_kv(args["keys"], k_scale, key_cache.dtype),
        quantize_kv(args["values"], v_scale, value_cache.dtype),
        dest,
    )
    updated = {**args, "key_cache": key_cache, "value_cache": value_cache}
    out = ragged_page_attention_triton(cfg=cfg, **updated)
    return out, key_cache, value_cache
