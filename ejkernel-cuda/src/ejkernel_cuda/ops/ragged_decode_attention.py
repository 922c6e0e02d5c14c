"""ragged_decode_attention on CUDA: split-K flash decoding over a dense cache (forward only).

Native kernel (``csrc/decode_attention.cu``, Flash-Decoding, Dao et al. 2023): each CTA reads
one key-range split of one row for the query heads of one GQA group (every K/V read serves
all of them), 16-byte loads, an online softmax per token group, a float32 partial per split;
a second kernel merges the splits and the attention sinks. The dense cache is the paged
layout with one page per row, so this op and ``page_attention`` share the kernel
(:mod:`ejkernel_cuda.ops._decode`). Row ``b`` reads only ``[max(start, end - 1 - left), end)``:
the clamping and the sliding window are folded into that range before the launch.

``supports()`` declines: scaled caches (``k_scale``/``v_scale``, float8: the XLA plugin
serves them), dtypes other than bfloat16/float16/float32, ``Dv != D``, head dims that are not
a multiple of 8 or exceed 256, and, when nvcc is missing or the build failed, every call (the
reason carries the compiler's message). The op is forward-only (its spec is not
differentiable).
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_cuda.ops._decode import DecodeConfig, decode, decode_supports, decode_tuning

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


heuristic, config_space = decode_tuning(_dims, RaggedDecodeAttentionConfig)


def supports(inv: Any) -> bool | str:
    kw = inv.kwargs
    return decode_supports(kw["query"], kw["value"], kw.get("k_scale"), kw.get("v_scale"))


def ragged_decode_attention_cuda(
    *, cfg: RaggedDecodeAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Decode attention over ``[start, end)`` of a dense cache: the arguments of
    ``ejkernel.ragged_decode_attention`` as keywords, validated by the core spec.

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
    return decode(
        args["query"],
        args["key"],
        args["value"],
        (args["sequence_start"], args["sequence_end"]),
        bounds=_bounds,
        table=None,
        softmax_aux=args.get("softmax_aux"),
        dims=_dims(args),
        cfg=cfg,
        options=args,
    )


def _bounds(start: jax.Array, end: jax.Array, sk: int, left: int | None) -> Any:
    """Row ``b`` sees ``[max(start, end - 1 - left), end)``, both clamped to ``[0, Sk]``."""
    start = jnp.clip(start.astype(jnp.int32), 0, sk)
    end = jnp.clip(end.astype(jnp.int32), 0, sk)
    return (start if left is None else jnp.maximum(start, end - 1 - left)), end
