"""scaled_dot_product_attention on CUDA: cuDNN's fused attention through XLA.

The same vendor route as :mod:`ejkernel_cuda.ops.flash_attention` (the op is flash attention
without dropout and sinks); ``supports()`` declines the same shapes and features, with the
same reasons.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel_cuda.ops.flash_attention import cudnn_attention, cudnn_supports

__all__ = ["scaled_dot_product_attention_cuda", "supports"]


def supports(inv: Any) -> bool | str:
    return cudnn_supports(inv.kwargs)


def scaled_dot_product_attention_cuda(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Scaled dot-product attention through cuDNN (arguments as validated).

    Args: as :func:`ejkernel_cuda.ops.flash_attention.flash_attention_cuda`.

    Returns:
        [B, Sq, Hq, D] in the query dtype.
    """
    del q_segment_ids, kv_segment_ids, logits_soft_cap, cfg
    return cudnn_attention(
        query,
        key,
        value,
        bias=bias,
        attention_mask=attention_mask,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
    )
