"""attention: materialised softmax attention that also returns its probabilities.

Flash attention's arguments and semantics (:mod:`ejkernel.specs.flash_attention`), with the
``[B, Hq, Sq, Sk]`` probability matrix as a second output. ``weights`` is exactly the matrix the
output was computed from, ``out = weights @ value`` (per head, GQA heads sharing their key/value
head), so:

- with sinks (``softmax_aux``) the sink logits join the denominator, so a row sums to less
  than one (the missing mass went to the sinks);
- with dropout, ``weights`` is the dropped matrix: dropped entries are 0 and kept ones are
  scaled by ``1 / (1 - dropout_prob)`` (the same entries as flash attention drops);
- a row with no visible key is all zeros, in ``weights`` and in ``out``.

Both outputs keep the query dtype (float32 inside). The op is differentiable in ``query``,
``key``, ``value``, ``bias`` and ``softmax_aux`` through both outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import finite_or_zero
from ejkernel.specs._base import builtin_op_spec, call_op
from ejkernel.specs.flash_attention import (
    flash_attention_reference,
    validate_flash_attention,
)

__all__ = ["SPEC", "attention", "attention_reference"]

OP = "attention"


def attention_reference(
    query: jax.Array, key: jax.Array, value: jax.Array, **options: Any
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, Sq, Hq, Dv], weights [B, Hq, Sq, Sk])`` in float32, cast to the query dtype.

    ``options`` are the keyword arguments of :func:`attention`. The probabilities are flash
    attention's oracle applied to an identity value: with ``value[b, k, h, :] = e_k`` its output
    row is the probability row itself, so both ops share one definition of masking, sinks and
    dropout (and the default ``softmax_scale``, the query's ``D ** -0.5``).
    """
    b, _, hq, _ = query.shape
    sk, hkv = key.shape[1], key.shape[2]
    identity = jnp.broadcast_to(jnp.eye(sk, dtype=jnp.float32)[None, :, None, :], (b, sk, hkv, sk))
    rows = flash_attention_reference(
        query.astype(jnp.float32),  # float32 in, so the probabilities come back unrounded
        key.astype(jnp.float32),
        identity,
        **options,
    )
    weights = rows.transpose(0, 2, 1, 3)  # [B, Sq, Hq, Sk] -> [B, Hq, Sq, Sk]
    v = jnp.repeat(finite_or_zero(value.astype(jnp.float32)), hq // hkv, axis=2)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.astype(query.dtype), weights.astype(query.dtype)


def attention(
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
) -> tuple[jax.Array, jax.Array]:
    """Materialised attention returning the output and the probabilities it used.

    Memory is O(Sq · Sk) per head (the probabilities are an output); use
    :func:`ejkernel.flash_attention` when they are not needed.

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
        dropout_prob: dropout on the attention probabilities (``weights`` is the dropped,
            rescaled matrix).
        dropout_seed: int or integer scalar array; default 0 (the entries flash attention
            drops for the same seed).
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        ``(out, weights)``: out [B, Sq, Hq, Dv] and weights [B, Hq, Sq, Sk], both in the
        query dtype, with ``out = weights @ value``; rows with no visible key are zeros.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    attention,
    differentiable=("query", "key", "value", "bias", "softmax_aux"),
    validate=lambda a: validate_flash_attention(a, op=OP),
)
