"""ragged_decode_attention on XLA: decode over the valid range of a dense cache (forward only).

Runs the work-list core of :mod:`ejkernel_xla.ops.ragged_page_attention` with one work item per
batch row (its query at position ``end - 1``) and a dense key fetch: block ``j`` of row ``b``
is ``key[b, j·bk : (j+1)·bk]`` (the last block shifted left to end at ``Sk``, its re-read keys
masked), and a row only visits the blocks overlapping ``[start, end)`` (narrowed further by
the sliding window). Under ``jax.jit`` the work is ``Σ`` over rows of their valid range, not
``B · Sk``.

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
    Sequences,
    Statics,
    attend,
    dense_fetch,
    make_statics,
    paged_config_space,
    paged_heuristic,
)

__all__ = [
    "RaggedDecodeAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_decode_attention_xla",
]


@attrs.frozen(kw_only=True)
class RaggedDecodeAttentionConfig(RaggedPageAttentionConfig):
    """Tunables of the XLA ragged decode: ``kv_blocksize`` keys per block (clamped to Sk) and
    ``blocks_per_step``; ``q_blocksize`` is moot (one query per row)."""


def _problem(query: Any, key: Any, value: Any) -> Problem:
    b = int(query.shape[0])
    return Problem(
        tokens=b,
        seqs=b,
        hq=int(query.shape[1]),
        kv_width=int(key.shape[2]) * int(key.shape[3] + value.shape[3]),
        page_size=1,
        capacity=int(key.shape[1]),
        decode=True,
    )


def heuristic(inv: Any) -> RaggedDecodeAttentionConfig:
    """~256-key blocks (at most Sk), a step budget per backend."""
    kw = inv.kwargs
    return paged_heuristic(
        _problem(kw["query"], kw["key"], kw["value"]), RaggedDecodeAttentionConfig
    )


def config_space(inv: Any) -> list[RaggedDecodeAttentionConfig]:
    kw = inv.kwargs
    return paged_config_space(
        _problem(kw["query"], kw["key"], kw["value"]), RaggedDecodeAttentionConfig
    )


def ragged_decode_attention_xla(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: tuple[int, int] | None = None,
    softmax_aux: jax.Array | None = None,
    cfg: RaggedDecodeAttentionConfig | None = None,
) -> jax.Array:
    """Decode attention over ``[start, end)`` of a dense cache (arguments as validated).

    Args:
        query: [B, Hq, D].
        key: [B, Sk, Hkv, D].
        value: [B, Sk, Hkv, Dv].
        sequence_start: [B] int.
        sequence_end: [B] int.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before masking, or ``None``.
        sliding_window: ``(left, right)`` or ``None``.
        softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        cfg: blocks; ``None`` takes the heuristic's.

    Returns:
        [B, Hq, Dv] in the query dtype.
    """
    st = make_statics(
        _problem(query, key, value),
        cfg,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        causal=True,
        d=int(query.shape[-1]),
    )
    return _forward(query, key, value, sequence_start, sequence_end, softmax_aux, st)


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
    softmax_aux: jax.Array | None,
    st: Statics,
) -> jax.Array:
    b, sk = key.shape[:2]
    start = jnp.clip(sequence_start.astype(jnp.int32), 0, sk)
    end = jnp.clip(sequence_end.astype(jnp.int32), 0, sk)
    seqs = Sequences(
        q_begin=jnp.arange(b, dtype=jnp.int32),
        q_len=jnp.ones((b,), jnp.int32),
        q_pos0=end - 1,  # the decode token is the newest one
        kv_lo=start,
        kv_hi=end,
    )
    return attend(query, seqs, dense_fetch(key, value, st.kv_block), st, softmax_aux=softmax_aux)
