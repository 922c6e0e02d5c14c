"""What the Mosaic TPU kernel bodies share: arithmetic where Mosaic's lowering needs a
particular form, the matmul precision and a ``pl.when`` that takes Python bools."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import finite_or_zero as _finite_or_zero
from ejkernel_pallas import _compat

__all__ = ["finite_or_zero", "precision", "when"]


def finite_or_zero(x: Any) -> Any:
    """:func:`ejkernel.attention_semantics.finite_or_zero` taken in float32 (exact for 16-bit
    data): Mosaic tests the finiteness of 32-bit floats only."""
    if jnp.dtype(x.dtype) == jnp.float32:
        return _finite_or_zero(x)
    return _finite_or_zero(x.astype(jnp.float32)).astype(x.dtype)


def precision(dtype: Any) -> Any:
    """The matmul precision of ``dtype`` operands: ``HIGHEST`` for float32, else the default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def when(cond: Any) -> Callable[[Callable[[], None]], None]:
    """``pl.when`` that also takes a Python bool (resolved at trace time)."""

    def run(fn: Callable[[], None]) -> None:
        if cond is True:
            fn()
        elif cond is not False:
            _compat.pl.when(cond)(fn)

    return run
