"""ragged_decode_attention on XLA: decode over the valid range of a dense cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` with one work item per batch
row (its query at position ``end - 1``) and a dense key fetch: block ``j`` of row ``b``
is ``key[b, j·bk : (j+1)·bk]`` (the last block shifted left to end at ``Sk``, its re-read keys
masked), and a row only visits the blocks overlapping ``[start, end)`` (narrowed further by
the sliding window). Under ``jax.jit`` the work is ``Σ`` over rows of their valid range, not
``B · Sk``.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.specs.ragged_decode_attention import SPEC
from ejkernel_xla.ops import _paged as engine

__all__ = [
    "RaggedDecodeAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_decode_attention_xla",
]


@attrs.frozen(kw_only=True)
class RaggedDecodeAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA ragged decode: ``kv_blocksize`` keys per block (clamped to Sk) and
    ``blocks_per_step``; ``q_blocksize`` is moot (one query per row)."""


def _problem(kw: Mapping[str, Any]) -> engine.Problem:
    """A dense cache: pages of one key, a capacity of Sk."""
    query, key, value = kw["query"], kw["key"], kw["value"]
    b = int(query.shape[0])
    return engine.Problem(
        tokens=b,
        seqs=b,
        hq=int(query.shape[1]),
        kv_width=int(key.shape[2]) * int(key.shape[3] + value.shape[3]),
        page_size=1,
        capacity=int(key.shape[1]),
        decode=True,
        head_dim=int(query.shape[-1]),
    )


heuristic, config_space = engine.tuning(RaggedDecodeAttentionConfig, _problem)


def ragged_decode_attention_xla(
    *, cfg: RaggedDecodeAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Decode attention over ``[start, end)`` of a dense cache.

    Args:
        cfg: blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_decode_attention`'s arguments by name, as its spec
            validated them.

    Returns:
        [B, Hq, Dv] in the query dtype.
    """
    return engine.serve(SPEC, _forward, _problem, cfg, args)


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: engine.Statics) -> jax.Array:
    key, value = a["key"], a["value"]
    sk = key.shape[1]
    start = jnp.clip(a["sequence_start"].astype(jnp.int32), 0, sk)
    end = jnp.clip(a["sequence_end"].astype(jnp.int32), 0, sk)
    seqs = engine.decode_sequences(end - 1, start, end)  # the decode token is the newest one
    fetch = engine.dense_fetch(key, value, st.kv_block, k_scale=a["k_scale"], v_scale=a["v_scale"])
    reads = (key, value)
    return engine.attend(a["query"], seqs, fetch, st, softmax_aux=a["softmax_aux"], reads=reads)
