"""Arithmetic the Mosaic TPU kernels share, where Mosaic's lowering needs a particular form."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ejkernel.attention_semantics import finite_or_zero as _finite_or_zero

__all__ = ["finite_or_zero"]


def finite_or_zero(x: Any) -> Any:
    """:func:`ejkernel.attention_semantics.finite_or_zero` taken in float32 (exact for 16-bit
    data): Mosaic tests the finiteness of 32-bit floats only."""
    if jnp.dtype(x.dtype) == jnp.float32:
        return _finite_or_zero(x)
    return _finite_or_zero(x.astype(jnp.float32)).astype(x.dtype)
