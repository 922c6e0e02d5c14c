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

from ejkernel.specs.prefill_page_attention import SPEC
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
    *, cfg: PrefillPageAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Causal prefill of one sequence over its pages.

    Args:
        cfg: blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.prefill_page_attention`'s arguments by name, as its spec
            validated them.

    Returns:
        [C, Hq, D] in the query dtype.
    """
    return engine.serve(SPEC, _forward, _problem, cfg, args)


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: engine.Statics) -> jax.Array:
    query, key_cache = a["query"], a["key_cache"]
    c = query.shape[0]
    tables = a["page_indices"][None]
    kv_lens = jnp.asarray(a["kv_len"], jnp.int32).reshape(1)
    starts = jnp.array([0, c], jnp.int32)
    seqs = engine.paged_sequences(
        kv_lens, starts, jnp.int32(1), c, tables.shape[1] * key_cache.shape[1]
    )
    return engine.attend_pages(query, seqs, st, a, tables)
