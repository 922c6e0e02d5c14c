"""ragged_decode_attention: one decode query per row over the valid range of a dense cache.

Semantics (OPS.md vocabulary): row ``b`` of the dense cache ``key``/``value`` ``[B, Sk, Hkv, ·]``
holds valid keys at positions ``[sequence_start[b], sequence_end[b])`` (both clamped to
``[0, Sk]``); its query is the newest token, at position ``p = sequence_end[b] - 1``, and sees
the valid keys, restricted to ``[p - left, p + right]`` by ``sliding_window`` (``right`` is moot:
nothing lies past ``p``). Logits are ``softmax_scale · q·kᵀ``, then ``cap · tanh(x / cap)``
when ``logits_soft_cap`` is set; ``softmax_aux`` sink logits ``[Hq]`` or ``[Hq, n]`` join the
denominator only. An empty range (``end <= start``) returns zeros. GQA: query head ``h`` reads
KV head ``h // (Hq // Hkv)``. Accumulation is float32; the output keeps the query dtype.
With ``k_scale``/``v_scale`` (a float, or float32 ``[Hkv]``) ``key``/``value``, then possibly
``float8_e4m3fn``, are read as ``cache.astype(float32) · scale``, per KV head for ``[Hkv]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.attention_semantics import dequantize_kv
from ejkernel.specs._base import (
    OpSpec,
    call_op,
    check_array,
    check_floating,
    check_qkv,
    default_synthetic,
)
from ejkernel.specs._paged import (
    FP8,
    attend_rows,
    check_cache_dtype,
    check_index_vector,
    check_kv_scales,
    check_sinks,
    reference_of,
    synthetic_scales,
    window_mask,
)
from ejkernel.specs.flash_attention import attention_statics

__all__ = [
    "SPEC",
    "ragged_decode_attention",
    "ragged_decode_attention_reference",
    "validate_ragged_decode_attention",
]

OP = "ragged_decode_attention"


def validate_ragged_decode_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; fill defaults. Raises ValueError/TypeError."""
    q, k, v = a["query"], a["key"], a["value"]
    letters = ("[B, Hq, D]", "[B, Sk, Hkv, D]", "[B, Sk, Hkv, Dv]")
    if getattr(k, "dtype", None) == FP8 and getattr(v, "dtype", None) == FP8:
        # A float8_e4m3fn cache is read with k_scale/v_scale beside a wider query.
        for name, x, spelled, ndim in zip(("query", "key", "value"), (q, k, v), letters, (3, 4, 4)):
            check_array(OP, name, x, ndim=ndim, letters=spelled)
        check_floating(OP, (("query", q),))
        check_cache_dtype(OP, "query", q.dtype, k.dtype, pair="`key`/`value`")
    else:
        if hasattr(k, "dtype"):
            check_cache_dtype(OP, "key", k.dtype)  # a float8 other than e4m3fn, named as such
        check_qkv(OP, q, k, v, letters=letters, query_ndim=3)
    b, hq, d = (int(n) for n in q.shape)
    if (
        int(k.shape[0]) != b
        or int(k.shape[3]) != d
        or int(k.shape[2]) == 0
        or hq % int(k.shape[2]) != 0
    ):
        raise ValueError(
            f"{OP}: `key` must be [B, Sk, Hkv, D] with Hq % Hkv == 0; got key.shape="
            f"{tuple(k.shape)}, query.shape={tuple(q.shape)}"
        )
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(
            f"{OP}: `value` must be [B, Sk, Hkv, Dv]; got value.shape={tuple(v.shape)}, key.shape={tuple(k.shape)}"
        )
    if min(hq, d, int(k.shape[1]), int(v.shape[3])) == 0:  # B == 0 is an empty call
        raise ValueError(
            f"{OP}: `query`/`key`/`value` must have non-empty Hq, D, Sk and Dv; got {q.shape}, {k.shape}, {v.shape}"
        )
    for name in ("sequence_start", "sequence_end"):
        check_index_vector(OP, name, a[name], letters="[B]", length=b)
    check_sinks(OP, a.get("softmax_aux"), hq)
    check_kv_scales(OP, a, hkv=int(k.shape[2]), cache_dtype=k.dtype, caches=("key", "value"))
    attention_statics(OP, a, d=d)
    return a


def _synthetic(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    out = synthetic_scales(abstract, default_synthetic(abstract, seed), seed)
    rng = np.random.default_rng(seed)
    b, sk = abstract["key"].shape[:2]
    end = rng.integers(1, sk + 1, size=b)
    start = np.array([rng.integers(0, e) for e in end])
    # NumPy, not jnp: tuning starts while a trace is active, where jnp operations are staged.
    out["sequence_start"] = start.astype(abstract["sequence_start"].dtype)
    out["sequence_end"] = end.astype(abstract["sequence_end"].dtype)
    return out


def ragged_decode_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
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
    """Decode attention over the valid range ``[start, end)`` of each row of a dense cache.

    Args:
        query: [B, Hq, D], the newest token of each row (at position ``end - 1``).
        key: [B, Sk, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value: [B, Sk, Hkv, Dv].
        sequence_start: [B] int32, first valid position (clamped to [0, Sk]).
        sequence_end: [B] int32, one past the last valid position (clamped to [0, Sk]).
        softmax_scale: multiplies the logits; default D ** -0.5.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        sliding_window: ``(left, right)`` or ``w``; the query sees keys in
            ``[end - 1 - left, end - 1]``.
        softmax_aux: [Hq] or [Hq, n] attention-sink logits (denominator only).
        k_scale: ``None``, a float, or float32 [Hkv]: ``key`` is read as
            ``key.astype(float32) * k_scale`` (per KV head for [Hkv]); required when the
            cache is float8_e4m3fn (the query keeps its own, wider floating dtype).
        v_scale: the same for ``value``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        [B, Hq, Dv] in the query dtype (Dv = D in the usual case); empty ranges give zeros.
    """
    return call_op(SPEC, locals())


@reference_of(ragged_decode_attention)
def ragged_decode_attention_reference(a: dict[str, Any]) -> jax.Array:
    """Plain-JAX oracle: one masked softmax per row over its whole dense cache (read through
    :func:`ejkernel.attention_semantics.dequantize_kv`)."""
    query, key = a["query"], a["key"]
    sk = key.shape[1]
    softmax_scale = a["softmax_scale"]
    if softmax_scale is None:
        softmax_scale = query.shape[-1] ** -0.5
    start = jnp.clip(a["sequence_start"].astype(jnp.int32), 0, sk)[:, None]
    end = jnp.clip(a["sequence_end"].astype(jnp.int32), 0, sk)[:, None]
    k_pos = jnp.arange(sk)[None, :]
    visible = (k_pos >= start) & (k_pos < end)
    visible &= window_mask(k_pos, end - 1, causal=True, sliding_window=a["sliding_window"])
    return attend_rows(
        query,
        dequantize_kv(key, a["k_scale"]),
        dequantize_kv(a["value"], a["v_scale"]),
        visible,
        softmax_scale=softmax_scale,
        logits_soft_cap=a["logits_soft_cap"],
        softmax_aux=a["softmax_aux"],
    )


SPEC = OpSpec.from_function(
    ragged_decode_attention,
    validate=validate_ragged_decode_attention,
    reference=ragged_decode_attention_reference,
    synthetic=_synthetic,
    examples="ejkernel.testing.cases.ragged_decode_attention:examples",
)
