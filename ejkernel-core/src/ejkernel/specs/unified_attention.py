"""unified_attention: vLLM-style prefill and decode in one call over a paged cache (forward only).

Semantics (OPS.md vocabulary; the packed queries and paged layout of
:mod:`ejkernel.specs.ragged_page_attention`, every sequence live): sequence ``s`` owns tokens
``query_start_loc[s] : query_start_loc[s + 1]``, its last ``q_len`` tokens, so query ``i``
sits at position ``p = kv_lens[s] - q_len + i``. Logits are ``softmax_scale · q·kᵀ``, then
``cap · tanh(x / cap)`` when ``logits_soft_cap`` is set, then the ALiBi bias
``alibi_slopes[h] · (key_pos - p)`` (Press et al., 2022: zero on the diagonal, more negative
with distance for positive slopes), then masking: keys ``< kv_lens[s]``; ``causal`` (default)
keys ``<= p``; ``sliding_window=(left, right)`` keys in ``[p - left, p + right]``.
``softmax_aux`` sink logits ``[Hq]`` or ``[Hq, n]`` join the denominator only. Rows that see
no key return zeros. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Accumulation
is float32; the output keeps the query dtype. With ``k_scale``/``v_scale`` (a float, or
float32 ``[Hkv]``) the caches, then possibly ``float8_e4m3fn``, are read as
``cache.astype(float32) · scale``, per KV head for ``[Hkv]``.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel.specs._base import OpSpec, call_op, check_array, is_floating
from ejkernel.specs._paged import (
    packed_paged_reference,
    reference_of,
    synthetic_paged_inputs,
)
from ejkernel.specs.ragged_page_attention import validate_ragged_page_attention

__all__ = ["SPEC", "unified_attention", "unified_attention_reference", "validate_unified_attention"]

OP = "unified_attention"


def validate_unified_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; fill defaults. Raises ValueError/TypeError."""
    a.setdefault("causal", True)
    validate_ragged_page_attention(a, op=OP)
    hq = int(a["queries"].shape[1])
    slopes = a.get("alibi_slopes")
    if slopes is not None:
        check_array(OP, "alibi_slopes", slopes, ndim=1, letters="[Hq]")
        if int(slopes.shape[0]) != hq or not is_floating(slopes):
            raise ValueError(
                f"{OP}: `alibi_slopes` must be floating [Hq] with Hq={hq}; got "
                f"alibi_slopes.shape={tuple(slopes.shape)}, dtype {slopes.dtype}"
            )
    return a


def unified_attention(
    queries: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    *,
    alibi_slopes: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """vLLM-style attention of packed prefill and decode queries over a paged cache.

    Args:
        queries: [T, Hq, D], the packed queries of every sequence.
        key_cache: [num_pages, page_size, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int32, tokens in the cache per sequence (its queries included).
        block_tables: [num_seqs, max_pages] int32, page ids in order; slots past
            ``ceil(kv_len / page_size)`` are never read and may hold any value.
        query_start_loc: [num_seqs + 1] int32, offsets of each sequence's queries (its last
            tokens) in ``queries``.
        alibi_slopes: [Hq] floats; adds ``slope · (key_pos - query_pos)`` to the logits.
        softmax_aux: [Hq] or [Hq, n] attention-sink logits (denominator only).
        softmax_scale: multiplies the logits; default D ** -0.5.
        causal: a query sees keys at positions <= its own (default True).
        sliding_window: ``(left, right)`` or ``w``: keys in ``[p - left, p + right]``.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before ALiBi and masking.
        k_scale: ``None``, a float, or float32 [Hkv]: ``key_cache`` is read as
            ``key_cache.astype(float32) * k_scale`` (per KV head for [Hkv]); required when the
            cache is float8_e4m3fn (the queries keep their own, wider floating dtype).
        v_scale: the same for ``value_cache``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        [T, Hq, D] in the query dtype; tokens of no sequence and rows that see no key are
        zeros.
    """
    return call_op(SPEC, locals())


@reference_of(unified_attention)
def unified_attention_reference(a: dict[str, Any]) -> jax.Array:
    """Plain-JAX oracle: gather each sequence's pages, then one masked softmax per token."""
    return packed_paged_reference(a)


SPEC = OpSpec.from_function(
    unified_attention,
    validate=validate_unified_attention,
    reference=unified_attention_reference,
    synthetic=synthetic_paged_inputs,
    examples="ejkernel.testing.cases.unified_attention:examples",
)
