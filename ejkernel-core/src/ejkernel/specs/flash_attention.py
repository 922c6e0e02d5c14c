"""flash_attention: exact softmax attention, O(N) memory, forward and backward.

Semantics every implementation follows (OPS.md vocabulary):

- logits = softmax_scale · q·kᵀ; then ``cap · tanh(logits / cap)`` when ``logits_soft_cap`` is
  set; then ``+ bias``; then masking (causal, sliding window, ``attention_mask``, segment ids).
- ``causal``: query i sits at position ``Sk - Sq + i`` (bottom-right aligned) and sees keys at
  positions ≤ its own. ``sliding_window=(left, right)`` keeps keys in ``[p - left, p + right]``.
- Segment ids: a query sees a key only when the ids are equal and non-negative.
- ``softmax_aux`` (attention sinks, ``[Hq]`` or ``[Hq, n]``): extra logits in the softmax
  denominator only.
- Dropout drops attention probabilities with a counter-based hash of
  ``(dropout_seed, batch, head, query index, key index)`` (:func:`dropout_keep`) so every
  implementation, blockwise or not, drops the same entries; kept ones are scaled by
  ``1 / (1 - dropout_prob)``.
- A row with no visible key returns zeros and has zero gradient. Accumulation is float32; the
  output keeps the query dtype. GQA/MQA: query head h uses key/value head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.attention_semantics import (
    Geometry,
    dense_visibility,
    finite_or_zero,
    hide,
    soft_cap,
)
from ejkernel.specs._base import (
    broadcastable,
    builtin_op_spec,
    call_op,
    check_array,
    check_flag,
    check_qkv,
    check_softmax_scale,
    is_floating,
    is_integer,
    static_number,
)

__all__ = [
    "SPEC",
    "attention_mask_dense",
    "attention_statics",
    "dropout_keep",
    "flash_attention",
    "flash_attention_reference",
    "validate_flash_attention",
]

OP = "flash_attention"

# Mixing constants of the dropout hash (murmur3's finaliser and the golden ratio).
_GOLDEN = 0x9E3779B9
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35


def _fmix32(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(_M2)
    return x ^ (x >> 16)


def dropout_keep(
    seed: Any, batch: Any, head: Any, q_index: Any, k_index: Any, dropout_prob: float
) -> jax.Array:
    """Whether attention probability ``(batch, head, q_index, k_index)`` survives dropout.

    A stateless uint32 hash: ``x = fmix(seed ^ batch·φ)``, then ``x = fmix(x ^ head·φ)``,
    ``x = fmix(x ^ q_index·φ)``, ``x = fmix(x ^ k_index·φ)`` with ``fmix`` murmur3's 32-bit
    finaliser and φ = 0x9E3779B9; an entry is kept when ``x >= dropout_prob · 2³²``. Arguments
    broadcast, so any backend can evaluate it per tile.
    """
    u = lambda v: jnp.asarray(v).astype(jnp.uint32)
    x = _fmix32(u(seed) ^ (u(batch) * jnp.uint32(_GOLDEN)))
    x = _fmix32(x ^ (u(head) * jnp.uint32(_GOLDEN)))
    x = _fmix32(x ^ (u(q_index) * jnp.uint32(_GOLDEN)))
    x = _fmix32(x ^ (u(k_index) * jnp.uint32(_GOLDEN)))
    threshold = np.uint32(min(int(dropout_prob * 4294967296.0), 4294967295))
    return x >= threshold


def attention_mask_dense(
    *,
    batch: int,
    num_heads: int,
    sq: int,
    sk: int,
    causal: bool,
    sliding_window: tuple[int, int] | None,
    attention_mask: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> jax.Array:
    """The visibility mask ``[B, Hq, Sq, Sk]`` (True = may attend) of every masking argument.

    A keyword form of :func:`ejkernel.attention_semantics.dense_visibility`.
    """
    geometry = Geometry(
        batch=batch,
        sq=sq,
        sk=sk,
        num_q_heads=num_heads,
        num_kv_heads=num_heads,
        causal=causal,
        window=sliding_window,
    )
    return dense_visibility(geometry, attention_mask, q_segment_ids, kv_segment_ids)


def flash_attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
) -> jax.Array:
    """Materialised attention in float32: the oracle every implementation is tested against."""
    b, sq, hq, d = query.shape
    sk, hkv = key.shape[1], key.shape[2]
    if softmax_scale is None:
        softmax_scale = d**-0.5
    if isinstance(sliding_window, int):
        sliding_window = (sliding_window, sliding_window)
    group = hq // hkv
    # Non-finite keys/values read as 0: a hidden one then contributes exactly nothing.
    q = query.astype(jnp.float32)
    k = jnp.repeat(finite_or_zero(key.astype(jnp.float32)), group, axis=2)
    v = jnp.repeat(finite_or_zero(value.astype(jnp.float32)), group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    logits = soft_cap(logits, logits_soft_cap)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    visible = attention_mask_dense(
        batch=b,
        num_heads=hq,
        sq=sq,
        sk=sk,
        causal=causal,
        sliding_window=sliding_window,
        attention_mask=attention_mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if softmax_aux is not None:
        aux = softmax_aux.astype(jnp.float32).reshape(hq, -1)  # [Hq, n]
        aux_max = jnp.max(aux, axis=-1)[None, :, None, None]
        row_max = jnp.maximum(row_max, aux_max)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    row_max = jax.lax.stop_gradient(row_max)
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.sum(jnp.exp(aux[None, :, None, :] - row_max), axis=-1, keepdims=True)
    any_visible = jnp.any(visible, axis=-1, keepdims=True)
    p = hide(jnp.where(any_visible, p / jnp.where(denom == 0, 1.0, denom), 0.0), visible)
    if dropout_prob > 0.0:
        seed = 0 if dropout_seed is None else dropout_seed
        keep = dropout_keep(
            seed,
            jnp.arange(b)[:, None, None, None],
            jnp.arange(hq)[None, :, None, None],
            jnp.arange(sq)[None, None, :, None],
            jnp.arange(sk)[None, None, None, :],
            dropout_prob,
        )
        p = jnp.where(keep, p / (1.0 - dropout_prob), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return out.astype(query.dtype)


def validate_flash_attention(a: dict[str, Any], *, op: str = OP) -> dict[str, Any]:
    """Check every argument of flash attention; fill defaults. Raises ValueError/TypeError."""
    q, k, v = a["query"], a["key"], a["value"]
    check_qkv(op, q, k, v, letters=("[B, Sq, Hq, D]", "[B, Sk, Hkv, D]", "[B, Sk, Hkv, Dv]"))
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] == 0 or hq % k.shape[2] != 0:
        raise ValueError(
            f"{op}: `key` must be [B, Sk, Hkv, D] with Hq % Hkv == 0; got key.shape="
            f"{tuple(k.shape)}, query.shape={tuple(q.shape)}"
        )
    sk, hkv = k.shape[1], k.shape[2]
    if v.shape[:3] != (b, sk, hkv):
        raise ValueError(
            f"{op}: `value` must be [B, Sk, Hkv, Dv]; got value.shape={tuple(v.shape)}, "
            f"key.shape={tuple(k.shape)}"
        )
    if min(sq, sk, d) == 0:
        raise ValueError(
            f"{op}: `query`/`key` must have non-empty Sq, Sk, D; got {q.shape}, {k.shape}"
        )
    target = (b, hq, sq, sk)
    if a.get("bias") is not None:
        bias = a["bias"]
        check_array(op, "bias", bias, ndim=(1, 2, 3, 4), letters="broadcastable to [B, Hq, Sq, Sk]")
        if not broadcastable(tuple(bias.shape), target) or not is_floating(bias):
            raise ValueError(
                f"{op}: `bias` must be floating and broadcastable to [B, Hq, Sq, Sk]={target}; "
                f"got bias.shape={tuple(bias.shape)}, dtype {bias.dtype}"
            )
    if a.get("attention_mask") is not None:
        m = a["attention_mask"]
        check_array(
            op,
            "attention_mask",
            m,
            ndim=(1, 2, 3, 4),
            letters="bool broadcastable to [B, Hq, Sq, Sk]",
        )
        if m.dtype != jnp.bool_:
            raise TypeError(
                f"{op}: `attention_mask` must be bool (True = may attend); got {m.dtype}"
            )
        if not broadcastable(tuple(m.shape), target):
            raise ValueError(
                f"{op}: `attention_mask` must be broadcastable to [B, Hq, Sq, Sk]={target}; "
                f"got attention_mask.shape={tuple(m.shape)}"
            )
    qs, ks = a.get("q_segment_ids"), a.get("kv_segment_ids")
    if (qs is None) != (ks is None):
        raise ValueError(f"{op}: `q_segment_ids` and `kv_segment_ids` must be given together")
    if qs is not None and ks is not None:
        for name, x, letters, want in (
            ("q_segment_ids", qs, "[B, Sq]", (b, sq)),
            ("kv_segment_ids", ks, "[B, Sk]", (b, sk)),
        ):
            check_array(op, name, x, ndim=2, letters=letters)
            if tuple(x.shape) != want:
                raise ValueError(
                    f"{op}: `{name}` must be {letters}={want}; got {name}.shape={tuple(x.shape)}"
                )
            if not is_integer(x):
                raise TypeError(f"{op}: `{name}` must be an integer array; got dtype {x.dtype}")
    if a.get("softmax_aux") is not None:
        aux = a["softmax_aux"]
        check_array(op, "softmax_aux", aux, ndim=(1, 2), letters="[Hq] or [Hq, n]")
        if aux.shape[0] != hq or not is_floating(aux):
            raise ValueError(
                f"{op}: `softmax_aux` must be floating [Hq] or [Hq, n] with Hq={hq}; got "
                f"softmax_aux.shape={tuple(aux.shape)}, dtype {aux.dtype}"
            )
    a.setdefault("causal", False)
    attention_statics(op, a, d=d)
    if "dropout_prob" in a:
        prob = a.get("dropout_prob")
        if isinstance(prob, jax.core.Tracer):
            raise TypeError(
                f"{op}: `dropout_prob` must be a Python float (it is static, part of the "
                f"compiled kernel); got a traced value"
            )
        prob = 0.0 if prob is None else static_number(op, "dropout_prob", prob)
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"{op}: `dropout_prob` must be in [0, 1); got {prob}")
        a["dropout_prob"] = prob
        seed = a.get("dropout_seed")
        if seed is not None:
            if not hasattr(seed, "dtype"):
                if not isinstance(seed, (int, np.integer)):
                    raise TypeError(
                        f"{op}: `dropout_seed` must be an int or an integer scalar array; got {seed!r}"
                    )
                if not -(2**31) <= seed < 2**31:
                    raise ValueError(
                        f"{op}: `dropout_seed` must be in [-2**31, 2**31) as a Python int; "
                        f"got {seed}"
                    )
            elif np.shape(seed) != () or not is_integer(seed):
                raise TypeError(
                    f"{op}: `dropout_seed` must be an integer scalar; got {np.shape(seed)} {seed.dtype}"
                )
        if prob > 0.0:
            a["dropout_seed"] = jnp.asarray(0 if seed is None else seed).astype(jnp.uint32)
        else:
            a["dropout_seed"] = None
    return a


def normalize_window(op: str, window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        window = (int(window), int(window))
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(
            f"{op}: `sliding_window` must be an int or (left, right) ints; got {window!r}"
        )
    left, right = int(window[0]), int(window[1])
    if left < 0 or right < 0:
        raise ValueError(f"{op}: `sliding_window` must be non-negative; got {(left, right)}")
    return (left, right)


def attention_statics(op: str, a: dict[str, Any], *, d: int) -> None:
    """Normalise the attention statics in place: ``softmax_scale`` (default ``D ** -0.5``),
    ``causal`` (when the op takes it), ``sliding_window`` and ``logits_soft_cap``."""
    a["softmax_scale"] = check_softmax_scale(op, a.get("softmax_scale"), d)
    if "causal" in a:
        a["causal"] = check_flag(op, "causal", a["causal"])
    a["sliding_window"] = normalize_window(op, a.get("sliding_window"))
    cap = a.get("logits_soft_cap")
    if cap is not None:
        cap = static_number(op, "logits_soft_cap", cap)
        if not cap > 0:
            raise ValueError(f"{op}: `logits_soft_cap` must be > 0; got {cap}")
        a["logits_soft_cap"] = cap


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Exact attention with O(N) memory, forward and backward, on the best installed platform.

    Args:
        query: [B, Sq, Hq, D].
        key: [B, Sk, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value: [B, Sk, Hkv, Dv].
        bias: added to the logits, broadcastable to [B, Hq, Sq, Sk]; differentiable.
        attention_mask: bool, broadcastable to [B, Hq, Sq, Sk], True = may attend.
        q_segment_ids: [B, Sq] int; with ``kv_segment_ids`` [B, Sk]: equal ids attend,
            negative ids are padding.
        softmax_aux: [Hq] or [Hq, n] attention-sink logits (denominator only); differentiable.
        softmax_scale: multiplies the logits; default D ** -0.5.
        causal: bottom-right aligned causal mask (query i at position Sk - Sq + i).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; intersected with ``causal``.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before bias and masking.
        dropout_prob: dropout on attention probabilities.
        dropout_seed: int or integer scalar array; default 0. The dropped entries are a hash
            of (seed, batch, head, query, key) and so identical on every platform.
        platform: force an installed platform (``"xla"``, ``"triton"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    flash_attention, differentiable=("query", "key", "value", "bias", "softmax_aux")
)
