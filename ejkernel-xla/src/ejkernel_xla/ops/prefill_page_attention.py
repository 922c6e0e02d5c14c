"""prefill_page_attention on XLA: causal chunked prefill of one sequence (forward only).

Runs the work-list core of :mod:`ejkernel_xla.ops.ragged_page_attention` on a batch of one
sequence: the ``C`` queries (positions ``kv_len - C + i``) are cut into work items of
``q_blocksize`` tokens, each paired with the key blocks it can see (causally, and within the
sliding window), gathered from ``page_indices`` only as far as ``ceil(kv_len / page_size)``.
Under ``jax.jit`` the work follows ``kv_len``, never ``num_pages`` or ``P``.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_xla.ops.ragged_page_attention import (
    Problem,
    RaggedPageAttentionConfig,
    Statics,
    attend,
    make_statics,
    paged_config_space,
    paged_fetch,
    paged_heuristic,
    paged_sequences,
)

__all__ = [
    "PrefillPageAttentionConfig",
    "config_space",
    "heuristic",
    "prefill_page_attention_xla",
]


@attrs.frozen(kw_only=True)
class PrefillPageAttentionConfig(RaggedPageAttentionConfig):
    """Tunables of the XLA chunked prefill: those of the ragged op."""


def _problem(query: Any, key_cache: Any, page_indices: Any) -> Problem:
    page_size = int(key_cache.shape[1])
    return Problem(
        tokens=int(query.shape[0]),
        seqs=1,
        hq=int(query.shape[1]),
        kv_width=2 * int(key_cache.shape[2] * key_cache.shape[3]),
        page_size=page_size,
        capacity=int(page_indices.shape[0]) * page_size,
        decode=False,
    )


def heuristic(inv: Any) -> PrefillPageAttentionConfig:
    """Query blocks of up to 32 (CPU) / 64 (GPU) tokens, ~256-key blocks of whole pages."""
    kw = inv.kwargs
    return paged_heuristic(
        _problem(kw["query"], kw["key_cache"], kw["page_indices"]), PrefillPageAttentionConfig
    )


def config_space(inv: Any) -> list[PrefillPageAttentionConfig]:
    kw = inv.kwargs
    return paged_config_space(
        _problem(kw["query"], kw["key_cache"], kw["page_indices"]), PrefillPageAttentionConfig
    )


def prefill_page_attention_xla(
    *,
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_len: jax.Array,
    page_indices: jax.Array,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: tuple[int, int] | None = None,
    cfg: PrefillPageAttentionConfig | None = None,
) -> jax.Array:
    """Causal prefill of one sequence over its pages (arguments as validated by the core spec).

    Args:
        query: [C, Hq, D].
        key_cache: [num_pages, page_size, Hkv, D].
        value_cache: [num_pages, page_size, Hkv, D].
        kv_len: int32 scalar.
        page_indices: [P] int.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before masking, or ``None``.
        sliding_window: ``(left, right)`` or ``None``.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [C, Hq, D] in the query dtype.
    """
    st = make_statics(
        _problem(query, key_cache, page_indices),
        cfg,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        causal=True,
        d=int(query.shape[-1]),
    )
    return _forward(query, key_cache, value_cache, kv_len, page_indices, st)


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_len: jax.Array,
    page_indices: jax.Array,
    st: Statics,
) -> jax.Array:
    c = query.shape[0]
    tables = page_indices[None]
    kv_lens = jnp.asarray(kv_len, jnp.int32).reshape(1)
    starts = jnp.array([0, c], jnp.int32)
    seqs = paged_sequences(kv_lens, starts, jnp.int32(1), c, tables.shape[1] * key_cache.shape[1])
    return attend(
        query, seqs, paged_fetch(key_cache, value_cache, tables, seqs.kv_hi, st.kv_block), st
    )
