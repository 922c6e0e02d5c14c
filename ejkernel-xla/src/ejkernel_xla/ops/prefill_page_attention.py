"""prefill_page_attention on XLA: causal chunked prefill of one sequence (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` on a batch of one
sequence: the ``C`` queries (positions ``kv_len - C + i``) are cut into work items of
``q_blocksize`` tokens, each paired with the key blocks it can see (causally, and within the
sliding window), gathered from ``page_indices`` only as far as ``ceil(kv_len / page_size)``.
Under ``jax.jit`` the work follows ``kv_len``, never ``num_pages`` or ``P``.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_xla.ops import _paged as engine

__all__ = [
    "PrefillPageAttentionConfig",
    "config_space",
    "heuristic",
    "prefill_page_attention_xla",
]


@attrs.frozen(kw_only=True)
class PrefillPageAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA chunked prefill (see :class:`~ejkernel_xla.ops._paged.PagedConfig`)."""


def _problem(kw: Mapping[str, Any]) -> engine.Problem:
    return engine.paged_problem(kw["query"], kw["key_cache"], kw["page_indices"])


heuristic, config_space = engine.tuning(PrefillPageAttentionConfig, _problem)


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
        key_cache, value_cache: [num_pages, page_size, Hkv, D].
        kv_len: int32 scalar; page_indices: [P] int.
        softmax_scale, logits_soft_cap, sliding_window: as the spec normalises them.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [C, Hq, D] in the query dtype.
    """
    st = engine.make_statics(
        _problem(locals()), cfg, softmax_scale, logits_soft_cap, sliding_window
    )
    return _forward(query, key_cache, value_cache, kv_len, page_indices, st)


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_len: jax.Array,
    page_indices: jax.Array,
    st: engine.Statics,
) -> jax.Array:
    c = query.shape[0]
    tables = page_indices[None]
    kv_lens = jnp.asarray(kv_len, jnp.int32).reshape(1)
    starts = jnp.array([0, c], jnp.int32)
    seqs = engine.paged_sequences(
        kv_lens, starts, jnp.int32(1), c, tables.shape[1] * key_cache.shape[1]
    )
    return engine.attend(
        query, seqs, engine.paged_fetch(key_cache, value_cache, tables, seqs.kv_hi, st.kv_block), st
    )
