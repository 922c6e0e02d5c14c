"""scaled_dot_product_attention: flash attention's arguments minus dropout and sinks.

Same semantics as :mod:`ejkernel.specs.flash_attention`; implementations may use vendor fused
kernels (cuDNN) where they exist. Served by flash attention (``served_by``): every platform's
flash-attention implementation runs this op too, with no dropout and no sinks, unless the
platform registers its own.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel.specs._base import builtin_op_spec, call_op
from ejkernel.specs.flash_attention import (
    flash_attention_reference,
    validate_flash_attention,
)

__all__ = ["SPEC", "scaled_dot_product_attention", "scaled_dot_product_attention_reference"]

OP = "scaled_dot_product_attention"


def scaled_dot_product_attention_reference(
    query: jax.Array, key: jax.Array, value: jax.Array, **options: Any
) -> jax.Array:
    """Materialised float32 attention: flash attention's reference without dropout or sinks.

    ``options`` are the keyword arguments of :func:`scaled_dot_product_attention`."""
    return flash_attention_reference(query, key, value, **options)


def scaled_dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
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
    """Scaled dot-product attention on the best installed platform (vendor kernels allowed).

    Args: as :func:`ejkernel.flash_attention`, without dropout and sinks.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    scaled_dot_product_attention,
    differentiable=("query", "key", "value", "bias"),
    validate=lambda a: validate_flash_attention(a, op=OP),
    served_by="flash_attention",
)
