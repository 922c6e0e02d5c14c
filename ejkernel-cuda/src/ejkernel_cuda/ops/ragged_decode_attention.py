"""ragged_decode_attention on CUDA: split-K flash decoding over a dense cache (forward only).

Native kernel (``csrc/decode_attention.cu``, Flash-Decoding, Dao et al. 2023): each CTA reads
one key-range split of one row for the query heads of one GQA group (every K/V read serves
all of them), 16-byte loads, an online softmax per token group, a float32 partial per split;
a second kernel merges the splits and the attention sinks. The dense cache is the paged
layout with one page per row, so this op and ``page_attention`` share the kernel
(:mod:`ejkernel_cuda.ops._decode`). Row ``b`` reads only ``[max(start, end - 1 - left), end)``:
the clamping and the sliding window are folded into that range before the launch.

``supports()`` declines: dtypes other than bfloat16/float16/float32, ``Dv != D``, head dims
that are not a multiple of 8 or exceed 256, and, when nvcc is missing or the build failed,
every call (the reason carries the compiler's message). The op is forward-only (its spec is
not differentiable).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_cuda.ops._decode import (
    DecodeConfig,
    decode_config_space,
    decode_heuristic,
    decode_supports,
    default_splits,
    native_decode,
)

__all__ = [
    "RaggedDecodeAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_decode_attention_cuda",
    "supports",
]


@attrs.frozen(kw_only=True)
class RaggedDecodeAttentionConfig(DecodeConfig):
    """``num_splits`` key-range splits per row (0: the heuristic's count)."""


def _dims(kw: Any) -> tuple[int, int, int, int, int]:
    q, k = kw["query"], kw["key"]
    return int(q.shape[0]), int(q.shape[1]), int(k.shape[2]), int(k.shape[1]), k.dtype.itemsize


def heuristic(inv: Any) -> RaggedDecodeAttentionConfig:
    """The fewest splits that fill the GPU's resident CTA slots (see ``default_splits``)."""
    return decode_heuristic(*_dims(inv.kwargs), RaggedDecodeAttentionConfig)  # type: ignore[no-any-return]


def config_space(inv: Any) -> list[RaggedDecodeAttentionConfig]:
    return decode_config_space(*_dims(inv.kwargs), RaggedDecodeAttentionConfig)


def supports(inv: Any) -> bool | str:
    kw = inv.kwargs
    return decode_supports(kw["query"], kw["key"], kw["value"])


def ragged_decode_attention_cuda(
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
        value: [B, Sk, Hkv, D].
        sequence_start: [B] int.
        sequence_end: [B] int.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        logits_soft_cap: ``cap * tanh(logits / cap)``, or ``None``.
        sliding_window: ``(left, right)`` or ``None`` (``right`` is moot for decode).
        softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        cfg: ``num_splits``; ``None`` or 0 takes the heuristic's.

    Returns:
        [B, Hq, D] in the query dtype; empty ranges give zeros.
    """
    b, hq, d = query.shape
    splits = cfg.num_splits if cfg is not None and cfg.num_splits > 0 else 0
    splits = splits or default_splits(
        b, hq, int(key.shape[2]), int(key.shape[1]), key.dtype.itemsize
    )
    scale = float(d**-0.5 if softmax_scale is None else softmax_scale)
    return _forward(
        query,
        key,
        value,
        sequence_start,
        sequence_end,
        softmax_aux,
        scale=scale,
        cap=logits_soft_cap,
        left=None if sliding_window is None else int(sliding_window[0]),
        splits=int(splits),
    )


@functools.partial(jax.jit, static_argnames=("scale", "cap", "left", "splits"))
def _forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
    softmax_aux: jax.Array | None,
    *,
    scale: float,
    cap: float | None,
    left: int | None,
    splits: int,
) -> jax.Array:
    sk = key.shape[1]
    start = jnp.clip(sequence_start.astype(jnp.int32), 0, sk)
    end = jnp.clip(sequence_end.astype(jnp.int32), 0, sk)
    lo = start if left is None else jnp.maximum(start, end - 1 - left)
    return native_decode(
        query,
        key,
        value,
        lo,
        end,
        None,
        softmax_aux,
        softmax_scale=scale,
        logits_soft_cap=cap,
        num_splits=splits,
    )
