"""prefill_page_attention: causal chunked prefill of one sequence over its pages (forward only).

Semantics (OPS.md vocabulary; the paged layout of :mod:`ejkernel.specs.ragged_page_attention`):
the sequence holds ``kv_len`` tokens in the pages ``page_indices[:ceil(kv_len / page_size)]``
(later entries are never read and may hold any value); the ``C`` queries are its last ``C``
tokens, so query ``i`` sits at position ``kv_len - C + i`` and sees the keys at positions
``<=`` its own (a query at a negative position, when ``C > kv_len``, sees nothing and returns
zeros), restricted to ``[p - left, p]`` by ``sliding_window``. ``logits_soft_cap`` applies
``cap · tanh(x / cap)`` before masking. ``kv_len`` is a Python int or an integer array of
shape ``()`` or ``(1,)`` (it may be traced). GQA: query head ``h`` reads KV head
``h // (Hq // Hkv)``. Accumulation is float32; the output keeps the query dtype.
With ``k_scale``/``v_scale`` (a float, or float32 ``[Hkv]``) the caches, then possibly
``float8_e4m3fn``, are read as ``cache.astype(float32) · scale``, per KV head for ``[Hkv]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.specs._base import OpSpec, call_op
from ejkernel.specs._paged import (
    check_counted_vector,
    check_paged_call,
    check_scalar_index,
    paged_reference,
    reference_of,
    synthetic_paged_inputs,
)
from ejkernel.specs.flash_attention import attention_statics

__all__ = [
    "SPEC",
    "prefill_page_attention",
    "prefill_page_attention_reference",
    "validate_prefill_page_attention",
]

OP = "prefill_page_attention"


def validate_prefill_page_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; fill defaults; ``kv_len`` becomes an int32 scalar array."""
    cache, _ = check_paged_call(OP, a, "query", "[C, Hq, D]")
    num_pages = check_counted_vector(OP, "page_indices", a["page_indices"], count="P")
    a["kv_len"] = check_scalar_index(OP, "kv_len", a["kv_len"], upper=num_pages * cache.page_size)
    attention_statics(OP, a, d=cache.d)
    return a


def prefill_page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_len: int | jax.Array,
    page_indices: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Causal attention of one sequence's prefill chunk over its pages (forward only).

    Args:
        query: [C, Hq, D], the sequence's last C tokens.
        key_cache: [num_pages, page_size, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value_cache: [num_pages, page_size, Hkv, D].
        kv_len: tokens in the cache (the chunk included): a Python int in
            ``[0, P · page_size]`` or an integer array of shape () or (1,), may be traced.
        page_indices: [P] int32, the sequence's page ids in order; entries past
            ``ceil(kv_len / page_size)`` are never read and may hold any value.
        softmax_scale: multiplies the logits; default D ** -0.5.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        sliding_window: ``(left, right)`` or ``w``; a query at position p sees keys in
            ``[p - left, p]``.
        k_scale: ``None``, a float, or float32 [Hkv]: ``key_cache`` is read as
            ``key_cache.astype(float32) * k_scale`` (per KV head for [Hkv]); required when the
            cache is float8_e4m3fn (the query keeps its own, wider floating dtype).
        v_scale: the same for ``value_cache``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        [C, Hq, D] in the query dtype; queries at negative positions give zeros.
    """
    return call_op(SPEC, locals())


@reference_of(prefill_page_attention)
def prefill_page_attention_reference(a: dict[str, Any]) -> jax.Array:
    """Plain-JAX oracle: gather the sequence's pages, one causal masked softmax per query."""
    c = a["query"].shape[0]
    kv_len = jnp.asarray(a["kv_len"], jnp.int32).reshape(1)
    # One sequence; the queries are its last C tokens.
    tokens = (jnp.zeros((c,), jnp.int32), kv_len[0] - c + jnp.arange(c), jnp.ones((c,), bool))
    return paged_reference(a["query"], a["page_indices"][None], kv_len, tokens, a)


SPEC = OpSpec.from_function(
    prefill_page_attention,
    validate=validate_prefill_page_attention,
    reference=prefill_page_attention_reference,
    synthetic=synthetic_paged_inputs,
    examples="ejkernel.testing.cases.prefill_page_attention:examples",
)
