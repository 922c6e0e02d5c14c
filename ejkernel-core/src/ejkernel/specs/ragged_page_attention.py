"""ragged_page_attention: mixed prefill and decode over a paged KV cache (forward only).

Semantics every implementation follows (OPS.md vocabulary):

- The paged layout: ``key_cache``/``value_cache`` ``[num_pages, page_size, Hkv, D]``; sequence
  ``s`` owns the pages ``block_tables[s, :ceil(kv_lens[s] / page_size)]`` in order, so its key
  at position ``p`` lives in page ``block_tables[s, p // page_size]``, slot ``p % page_size``.
  Table entries past the live pages are never read: they may hold any value (``-1``, ``10**6``).
  Sequences may share pages (a common prefix).
- ``queries [T, Hq, D]`` are packed: sequence ``s`` owns tokens
  ``query_start_loc[s] : query_start_loc[s + 1]``, its ``q_len`` queries being its *last*
  tokens, so query ``i`` sits at position ``kv_lens[s] - q_len + i`` (bottom-right causal: a
  decode step sees the whole cache, a prefill chunk sees its prefix and itself). A query whose
  position is negative (``q_len > kv_len``) sees no key.
- Only the first ``num_seqs`` sequences are live (a Python int, or an integer array of shape
  ``()`` or ``(1,)`` that may be traced, so one compiled kernel serves every batch size up to
  ``kv_lens.shape[0]``). Tokens of no live sequence, and rows that see no key, are zeros.
- logits = ``softmax_scale · q·kᵀ``; ``cap · tanh(logits / cap)`` when ``logits_soft_cap`` is
  set; then the causal mask and ``sliding_window=(left, right)`` (keys in ``[p - left,
  p + right]``; ``right`` is moot under causality); ``softmax_aux`` ``[Hq]`` or ``[Hq, n]``
  sink logits join the softmax denominator only. GQA: query head ``h`` reads KV head
  ``h // (Hq // Hkv)``. Accumulation is float32; the output keeps the query dtype.
- ``k_scale``/``v_scale`` (a float, or float32 ``[Hkv]``): the caches, then possibly
  ``float8_e4m3fn``, are read as ``cache.astype(float32) · scale``, per KV head for ``[Hkv]``
  (:func:`ejkernel.attention_semantics.dequantize_kv`); a float8 cache needs both.

Index values are never validated (they may be traced): lengths beyond a sequence's capacity
``max_pages · page_size`` are clamped to it, and malformed offsets give unspecified (but finite,
in-bounds) results.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel.specs._base import OpSpec, call_op
from ejkernel.specs._paged import (
    check_block_tables,
    check_counted_vector,
    check_index_vector,
    check_paged_call,
    check_scalar_index,
    check_sinks,
    packed_paged_reference,
    reference_of,
    synthetic_paged_inputs,
)
from ejkernel.specs.flash_attention import attention_statics

__all__ = [
    "SPEC",
    "ragged_page_attention",
    "ragged_page_attention_reference",
    "validate_ragged_page_attention",
]

OP = "ragged_page_attention"


def validate_ragged_page_attention(a: dict[str, Any], *, op: str = OP) -> dict[str, Any]:
    """Check every argument; fill defaults; ``num_seqs`` becomes an int32 scalar array."""
    cache, hq = check_paged_call(op, a, "queries", "[T, Hq, D]")
    num_seqs = check_counted_vector(
        op, "kv_lens", a["kv_lens"], count="num_seqs", allow_empty=a["queries"].shape[0] == 0
    )
    check_block_tables(op, "block_tables", a["block_tables"], num_seqs=num_seqs)
    check_index_vector(
        op, "query_start_loc", a["query_start_loc"], letters="[num_seqs + 1]", length=num_seqs + 1
    )
    if "num_seqs" in a:
        a["num_seqs"] = check_scalar_index(op, "num_seqs", a["num_seqs"], upper=num_seqs)
    check_sinks(op, a.get("softmax_aux"), hq)
    attention_statics(op, a, d=cache.d)
    return a


def ragged_page_attention(
    queries: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: int | jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_aux: jax.Array | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Mixed prefill and decode attention over a paged KV cache (forward only).

    Args:
        queries: [T, Hq, D], the packed queries of every sequence.
        key_cache: [num_pages, page_size, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int32, tokens in the cache per sequence (its queries included).
        block_tables: [num_seqs, max_pages] int32, page ids of each sequence in order; slots
            past ``ceil(kv_len / page_size)`` are never read and may hold any value.
        query_start_loc: [num_seqs + 1] int32, offsets of each sequence's queries in
            ``queries``; its ``q_len`` queries are the sequence's last tokens (causal).
        num_seqs: live sequences (the first ``num_seqs``): a Python int in
            ``[0, kv_lens.shape[0]]``, or an integer array of shape () or (1,), which may be
            traced (one compiled kernel for every batch size).
        softmax_scale: multiplies the logits; default D ** -0.5.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; with causality a query at
            position p sees keys in ``[p - left, p]``.
        softmax_aux: [Hq] or [Hq, n] attention-sink logits (denominator only).
        k_scale: ``None``, a float, or float32 [Hkv]: ``key_cache`` is read as
            ``key_cache.astype(float32) * k_scale`` (per KV head for [Hkv]); required when the
            cache is float8_e4m3fn (the queries keep their own, wider floating dtype).
        v_scale: the same for ``value_cache``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        [T, Hq, D] in the query dtype; tokens of no live sequence and rows that see no key
        are zeros.
    """
    return call_op(SPEC, locals())


@reference_of(ragged_page_attention)
def ragged_page_attention_reference(a: dict[str, Any]) -> jax.Array:
    """Plain-JAX oracle: gather each sequence's pages, then one masked softmax per token."""
    return packed_paged_reference(a)


SPEC = OpSpec.from_function(
    ragged_page_attention,
    validate=validate_ragged_page_attention,
    reference=ragged_page_attention_reference,
    synthetic=synthetic_paged_inputs,
    examples="ejkernel.testing.cases.ragged_page_attention:examples",
)
