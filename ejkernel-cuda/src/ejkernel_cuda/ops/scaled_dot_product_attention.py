"""scaled_dot_product_attention on CUDA: cuDNN's fused attention through XLA.

The same vendor route as :mod:`ejkernel_cuda.ops.flash_attention` (the op is flash attention
without dropout and sinks); ``supports()`` declines the same shapes and features, with the
same reasons.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel_cuda.ops.flash_attention import cudnn_attention, supports

__all__ = ["scaled_dot_product_attention_cuda", "supports"]


def scaled_dot_product_attention_cuda(*, cfg: Any = None, **args: Any) -> jax.Array:
    """Scaled dot-product attention through cuDNN: ``ejkernel.scaled_dot_product_attention``'s
    arguments as keywords (as :func:`ejkernel_cuda.ops.flash_attention.flash_attention_cuda`'s).

    Returns:
        [B, Sq, Hq, D] in the query dtype.
    """
    del cfg
    return cudnn_attention(**args)
