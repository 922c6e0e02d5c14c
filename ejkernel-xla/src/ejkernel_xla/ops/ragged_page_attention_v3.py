"""ragged_page_attention_v3 on XLA: write the new keys/values into their pages, then engine.attend.

The update is two scatters, ``cache.at[page, slot].set(new, mode="drop")``, of the ``T`` new
rows only (tokens that must not be written aim at page ``num_pages``, out of range, and are
dropped; with ``k_scale``/``v_scale`` the rows are first quantised to the cache dtype by
``attention_semantics.quantize_kv``: round to nearest, saturating), followed by the
work-list attention of :mod:`ejkernel_xla.ops._paged` on the updated caches, in one jitted
computation. Called under ``jax.jit`` with the caches donated, XLA aliases the returned
caches to the donated buffers and the update happens in place (O(T) writes); the attention
then gathers only the live pages, so the whole step never touches memory in proportion to
``num_pages``.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import quantize_kv
from ejkernel.specs.ragged_page_attention_v3 import SPEC
from ejkernel_xla.ops import _paged as engine

__all__ = [
    "RaggedPageAttentionV3Config",
    "config_space",
    "heuristic",
    "ragged_page_attention_v3_xla",
]


@attrs.frozen(kw_only=True)
class RaggedPageAttentionV3Config(engine.PagedConfig):
    """Tunables of the XLA fused update and attention (see
    :class:`~ejkernel_xla.ops._paged.PagedConfig`)."""


heuristic, config_space = engine.tuning(RaggedPageAttentionV3Config, engine.packed_problem)


def ragged_page_attention_v3_xla(
    *, cfg: RaggedPageAttentionV3Config | None = None, **args: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fused cache update and ragged paged attention.

    Args:
        cfg: blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_page_attention_v3`'s arguments by name, as its spec
            validated them; donate ``key_cache`` and ``value_cache``
            (``jax.jit(..., donate_argnums=...)``) for an in-place update.

    Returns:
        ``(out [T, Hq, D], key_cache, value_cache)``.
    """
    return engine.serve(SPEC, _forward, engine.packed_problem, cfg, args)


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: engine.Statics) -> tuple[jax.Array, jax.Array, jax.Array]:
    queries, key_cache, value_cache, block_tables = (
        a[n] for n in ("queries", "key_cache", "value_cache", "block_tables")
    )
    t = queries.shape[0]
    capacity = block_tables.shape[1] * key_cache.shape[1]
    seqs = engine.paged_sequences(a["kv_lens"], a["query_start_loc"], a["num_seqs"], t, capacity)
    page, slot = _destinations(seqs, block_tables, key_cache.shape[0], key_cache.shape[1], t)
    k_scale, v_scale = a["k_scale"], a["v_scale"]
    new_keys = quantize_kv(a["keys"], k_scale, key_cache.dtype)
    new_values = quantize_kv(a["values"], v_scale, value_cache.dtype)
    key_cache = key_cache.at[page, slot].set(new_keys, mode="drop")
    value_cache = value_cache.at[page, slot].set(new_values, mode="drop")
    updated = {**a, "key_cache": key_cache, "value_cache": value_cache}
    out = engine.attend_pages(queries, seqs, st, updated, block_tables)
    return out, key_cache, value_cache


def _destinations(
    seqs: engine.Sequences, block_tables: jax.Array, num_pages: int, page_size: int, tokens: int
) -> tuple[jax.Array, jax.Array]:
    """Page and slot of each new token; ``num_pages`` (dropped) for tokens not to be written."""
    t = jnp.arange(tokens, dtype=jnp.int32)
    s = block_tables.shape[0]
    seq = jnp.minimum(jnp.searchsorted(seqs.q_begin + seqs.q_len, t, side="right"), s - 1)
    i = t - seqs.q_begin[seq]
    position = seqs.q_pos0[seq] + i
    column = position // page_size
    live = (i >= 0) & (i < seqs.q_len[seq]) & (position >= 0) & (column < block_tables.shape[1])
    page = block_tables[seq, jnp.clip(column, 0, block_tables.shape[1] - 1)]
    live &= (page >= 0) & (page < num_pages)
    return jnp.where(live, page, num_pages), position % page_size
