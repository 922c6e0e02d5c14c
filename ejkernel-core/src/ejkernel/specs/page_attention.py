"""page_attention: one decode token per sequence over a paged KV cache (forward only).

Semantics (OPS.md vocabulary; the paged layout of :mod:`ejkernel.specs.ragged_page_attention`):
sequence ``s`` has one query, its newest token, at position ``kv_lens[s] - 1``; it sees the
keys at positions ``[0, kv_lens[s])`` held in the pages ``block_tables[s, :ceil(kv_lens[s] /
page_size)]`` (later table slots are never read and may hold any value), restricted to
``[p - left, p]`` by ``sliding_window``. ``logits_soft_cap`` applies ``cap · tanh(x / cap)``
before masking. A sequence with ``kv_lens[s] == 0`` returns zeros. GQA: query head ``h`` reads
KV head ``h // (Hq // Hkv)``. Accumulation is float32; the output keeps the query dtype.
With ``k_scale``/``v_scale`` (a float, or float32 ``[Hkv]``) the caches, then possibly
``float8_e4m3fn``, are read as ``cache.astype(float32) · scale``, per KV head for ``[Hkv]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.specs._base import OpSpec, call_op
from ejkernel.specs._paged import (
    check_block_tables,
    check_index_vector,
    check_paged_call,
    paged_reference,
    reference_of,
    synthetic_paged_inputs,
)
from ejkernel.specs.flash_attention import attention_statics

__all__ = ["SPEC", "page_attention", "page_attention_reference", "validate_page_attention"]

OP = "page_attention"


def validate_page_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; fill defaults. Raises ValueError/TypeError."""
    cache, _ = check_paged_call(OP, a, "query", "[S, Hq, D]")
    s = int(a["query"].shape[0])
    check_index_vector(OP, "kv_lens", a["kv_lens"], letters="[S]", length=s)
    check_block_tables(OP, "block_tables", a["block_tables"], num_seqs=s)
    attention_statics(OP, a, d=cache.d)
    return a


def page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Decode attention, one query per sequence, over a paged KV cache (forward only).

    Args:
        query: [S, Hq, D], the newest token of each sequence.
        key_cache: [num_pages, page_size, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [S] int32, tokens in the cache per sequence (the query's own included).
        block_tables: [S, max_pages] int32, page ids in order; slots past
            ``ceil(kv_len / page_size)`` are never read and may hold any value.
        softmax_scale: multiplies the logits; default D ** -0.5.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        sliding_window: ``(left, right)`` or ``w``; the query sees keys in
            ``[kv_len - 1 - left, kv_len - 1]``.
        k_scale: ``None``, a float, or float32 [Hkv]: ``key_cache`` is read as
            ``key_cache.astype(float32) * k_scale`` (per KV head for [Hkv]); required when the
            cache is float8_e4m3fn (the query keeps its own, wider floating dtype).
        v_scale: the same for ``value_cache``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        [S, Hq, D] in the query dtype; sequences with ``kv_len == 0`` give zeros.
    """
    return call_op(SPEC, locals())


@reference_of(page_attention)
def page_attention_reference(a: dict[str, Any]) -> jax.Array:
    """Plain-JAX oracle: gather each sequence's pages, one masked softmax per sequence."""
    s = a["query"].shape[0]
    kv_lens = a["kv_lens"]
    # One query per sequence, the newest token, at position kv_len - 1.
    tokens = (jnp.arange(s), kv_lens.astype(jnp.int32) - 1, jnp.ones((s,), bool))
    return paged_reference(a["query"], a["block_tables"], kv_lens, tokens, a)


SPEC = OpSpec.from_function(
    page_attention,
    validate=validate_page_attention,
    reference=page_attention_reference,
    synthetic=synthetic_paged_inputs,
    examples="ejkernel.testing.cases.page_attention:examples",
)
