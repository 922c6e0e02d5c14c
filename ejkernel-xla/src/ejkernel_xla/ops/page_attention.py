"""page_attention on XLA: one decode query per sequence, over a paged cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` with one work item per sequence (a
query block of one token, the query at position ``kv_len - 1``) and the paged key fetch, so
under ``jax.jit`` the work is ``Σ ceil(kv_len / kv_blocksize)`` key blocks (a sliding window
bounds it by the window): it grows with ``sum(kv_lens)``, never with ``num_pages`` or the table
width. Table slots past a sequence's live pages are never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.specs.page_attention import SPEC
from ejkernel_xla.ops import _paged as engine

__all__ = ["PageAttentionConfig", "config_space", "heuristic", "page_attention_xla"]


@attrs.frozen(kw_only=True)
class PageAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA page attention (see :class:`~ejkernel_xla.ops._paged.PagedConfig`;
    ``q_blocksize`` is moot: one query per sequence)."""


def _problem(kw: Mapping[str, Any]) -> engine.Problem:
    return engine.paged_problem(kw["query"], kw["key_cache"], kw["block_tables"], decode=True)


heuristic, config_space = engine.tuning(PageAttentionConfig, _problem)


def page_attention_xla(*, cfg: PageAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Decode attention over a paged cache.

    Args:
        cfg: blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.page_attention`'s arguments by name, as its spec validated them.

    Returns:
        [S, Hq, D] in the query dtype.
    """
    return engine.serve(SPEC, _forward, _problem, cfg, args)


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: engine.Statics) -> jax.Array:
    key_cache, block_tables = a["key_cache"], a["block_tables"]
    kv_len = a["kv_lens"].astype(jnp.int32)
    kv_hi = jnp.clip(kv_len, 0, block_tables.shape[1] * key_cache.shape[1])
    # The decode token is the newest one.
    seqs = engine.decode_sequences(kv_len - 1, jnp.zeros_like(kv_len), kv_hi)
    return engine.attend_pages(a["query"], seqs, st, a, block_tables)
