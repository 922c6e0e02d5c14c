"""blocksparse_attention: softmax attention over the key blocks a block mask allows.

Queries are cut into blocks of ``bq`` rows and keys into blocks of ``bk`` rows
(``block_size=(bq, bk)``); ``block_mask [B|1, Hq|1, nq, nk]`` with ``nq = ceil(Sq / bq)`` and
``nk = ceil(Sk / bk)`` says which (query block, key block) pairs are computed. When Sq or Sk is
not a multiple of its block, the last block is partial (it covers the remaining rows only).

Semantics: exactly flash attention (:mod:`ejkernel.specs.flash_attention`) with the block mask,
expanded to elements, intersected with every other mask: an entry is visible when its block is
live *and* causality, the sliding window, ``attention_mask`` and segment ids allow it. Rows
left with no visible key return zeros with zero gradients. Flash attention's masking arguments
(``bias``, ``attention_mask``, segment ids, ``softmax_scale``, ``causal``, ``sliding_window``,
``logits_soft_cap``) apply unchanged; dropout and sinks are not part of this op. Differentiable
in ``query``, ``key``, ``value`` and ``bias``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import builtin_op_spec, call_op, check_array
from ejkernel.specs.flash_attention import (
    flash_attention_reference,
    validate_flash_attention,
)

__all__ = [
    "SPEC",
    "blocksparse_attention",
    "blocksparse_attention_reference",
    "dense_block_mask",
    "validate_blocksparse_attention",
]

OP = "blocksparse_attention"

#: ``block_size`` when none is given.
DEFAULT_BLOCK_SIZE = (128, 128)


def _pair(block_size: Any) -> tuple[int, int]:
    if isinstance(block_size, (int, np.integer)):
        return int(block_size), int(block_size)
    return int(block_size[0]), int(block_size[1])


def dense_block_mask(
    block_mask: jax.Array, block_size: int | tuple[int, int], sq: int, sk: int
) -> jax.Array:
    """``[B|1, Hq|1, nq, nk]`` block mask -> the element mask ``[B|1, Hq|1, Sq, Sk]``.

    Each block entry covers ``bq × bk`` elements; the last (partial) blocks are cut to Sq, Sk.
    """
    bq, bk = _pair(block_size)
    dense = jnp.repeat(jnp.repeat(block_mask, bq, axis=2), bk, axis=3)
    return dense[:, :, :sq, :sk]


def blocksparse_attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block_mask: jax.Array,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    attention_mask: jax.Array | None = None,
    **options: Any,
) -> jax.Array:
    """Flash attention's float32 oracle with the block mask expanded into ``attention_mask``.

    ``options`` are the other keyword arguments of :func:`blocksparse_attention`."""
    mask = dense_block_mask(block_mask, block_size, query.shape[1], key.shape[1])
    if attention_mask is not None:
        mask = mask & attention_mask
    return flash_attention_reference(query, key, value, attention_mask=mask, **options)


def validate_blocksparse_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Flash attention's checks, then ``block_size`` and ``block_mask``; fills defaults."""
    a = validate_flash_attention(a, op=OP)
    b, sq, hq, _ = a["query"].shape
    sk = a["key"].shape[1]
    size = DEFAULT_BLOCK_SIZE if a.get("block_size") is None else a["block_size"]
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (size, size)
    if (
        not isinstance(size, (tuple, list))
        or len(size) != 2
        or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in size)
    ):
        raise TypeError(f"{OP}: `block_size` must be an int or (bq, bk) ints; got {size!r}")
    if min(size) < 1:
        raise ValueError(f"{OP}: `block_size` must be positive; got {tuple(size)}")
    bq, bk = int(size[0]), int(size[1])
    a["block_size"] = (bq, bk)
    nq, nk = -(-sq // bq), -(-sk // bk)
    mask = a["block_mask"]
    letters = f"bool [B|1, Hq|1, Sq/bq, Sk/bk] = [{b}|1, {hq}|1, {nq}, {nk}] (ceil division)"
    check_array(OP, "block_mask", mask, ndim=4, letters=letters)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{OP}: `block_mask` must be bool (True = compute the block); got {mask.dtype}"
        )
    mb, mh, mq, mk = mask.shape
    if mb not in (1, b) or mh not in (1, hq) or (mq, mk) != (nq, nk):
        raise ValueError(
            f"{OP}: `block_mask` must be {letters} for block_size=({bq}, {bk}), Sq={sq}, "
            f"Sk={sk}; got block_mask.shape={tuple(mask.shape)}"
        )
    return a


def blocksparse_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block_mask: jax.Array,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Attention that computes only the (query block, key block) pairs ``block_mask`` allows.

    Args:
        query: [B, Sq, Hq, D].
        key: [B, Sk, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value: [B, Sk, Hkv, Dv].
        block_mask: bool [B|1, Hq|1, Sq/bq, Sk/bk] (ceil division; the last blocks may be
            partial), True = compute the block. May be traced under ``jit``.
        block_size: ``(bq, bk)``, or ``b`` for ``(b, b)``; default (128, 128).
        bias: added to the logits, broadcastable to [B, Hq, Sq, Sk]; differentiable.
        attention_mask: bool, broadcastable to [B, Hq, Sq, Sk], True = may attend; intersected
            with the block mask.
        q_segment_ids: [B, Sq] int; with ``kv_segment_ids`` [B, Sk]: equal ids attend,
            negative ids are padding.
        softmax_scale: multiplies the logits; default D ** -0.5.
        causal: bottom-right aligned causal mask (query i at position Sk - Sq + i).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; intersected with ``causal``.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before bias and masking.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(blocksparse_attention, differentiable=("query", "key", "value", "bias"))
