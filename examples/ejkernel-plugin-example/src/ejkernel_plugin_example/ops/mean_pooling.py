"""mean_pooling on the ``example`` platform: prefix sums in plain JAX.

Algorithm: one float32 cumulative sum over the tokens, with a zero row in front, so the sum
of tokens ``[start, end)`` is ``csum[end] - csum[start]``; each sequence's sum divided by its
length (at least 1, so an empty sequence gives zeros). O(T·D) time and memory; the backward is
JAX's autodiff of these few operations (no hand-written VJP needed).

``supports()`` declines packs longer than :data:`MAX_TOKENS` tokens: the difference of two
large prefix sums cancels digits, and beyond that length float32 no longer holds the
reference's tolerance. The XLA plugin serves those calls.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["MAX_TOKENS", "mean_pooling_example", "supports"]

#: Longest pack (tokens) whose prefix sums stay within float32 tolerance of the reference.
MAX_TOKENS = 1 << 16


def supports(inv: Any) -> bool | str:
    """``True``, or why this call is left to another platform."""
    x = inv.kwargs["x"]
    tokens = x.shape[-2]
    if tokens > MAX_TOKENS:
        return f"prefix sums over {tokens} > {MAX_TOKENS} tokens lose float32 precision"
    return True


def mean_pooling_example(
    *, x: jax.Array, cu_seqlens: jax.Array | None = None, cfg: Any = None
) -> jax.Array:
    """Mean over each sequence's tokens (arguments as validated by the core spec).

    Args:
        x: [B, S, D]; or packed [T, D] / [1, T, D] with ``cu_seqlens``.
        cu_seqlens: [N + 1] integer offsets of packed sequences, or ``None``.
        cfg: unused (nothing to tune).

    Returns:
        [B, D] or [N, D] in the dtype of ``x``; empty sequences give zero rows.
    """
    del cfg
    if cu_seqlens is None and x.ndim == 3:
        return jnp.mean(x.astype(jnp.float32), axis=1).astype(x.dtype)
    tokens = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    num_tokens = tokens.shape[0]
    if cu_seqlens is None:
        cu_seqlens = jnp.asarray([0, num_tokens])
    offsets = jnp.clip(cu_seqlens.astype(jnp.int32), 0, num_tokens)
    starts, ends = offsets[:-1], jnp.maximum(offsets[1:], offsets[:-1])
    csum = jnp.concatenate([jnp.zeros_like(tokens[:1]), jnp.cumsum(tokens, axis=0)])
    lengths = jnp.maximum(ends - starts, 1).astype(jnp.float32)
    return ((csum[ends] - csum[starts]) / lengths[:, None]).astype(x.dtype)
