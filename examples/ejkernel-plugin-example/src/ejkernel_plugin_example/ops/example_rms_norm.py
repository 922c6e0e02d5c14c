"""example_rms_norm on the ``example`` platform: plain JAX with a hand-written backward.

Forward: ``r = rsqrt(mean(x², -1) + eps)``, ``n = x · r``, ``out = n · weight``, in float32;
``r`` is saved for the backward. Backward (the derivative of a normalisation): with
``g = d_out · weight``, ``d_x = r · (g - n · mean(g · n, -1))`` and
``d_weight = Σ d_out · n`` over every leading axis. Tied with
:func:`ejkernel.plugins.defvjp`, so the executor wires them into a ``jax.custom_vjp``.

It declines nothing, so the module defines no ``supports`` (core reads its absence as "every
valid call").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp

__all__ = ["example_rms_norm_example"]


def example_rms_norm_example(
    *, x: jax.Array, weight: jax.Array, eps: float, cfg: Any = None
) -> jax.Array:
    """RMS normalisation of ``x [..., D]`` scaled by ``weight [D]``, in the dtype of ``x``."""
    return _forward(x, weight, eps)[0]


def _example_rms_norm_fwd(
    *, x: jax.Array, weight: jax.Array, eps: float, cfg: Any = None
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """Forward: ``(out, (x, weight, r))``."""
    out, r = _forward(x, weight, eps)
    return out, (x, weight, r)


def _example_rms_norm_bwd(
    residuals: tuple[jax.Array, jax.Array, jax.Array],
    d_out: jax.Array,
    *,
    eps: float,
    cfg: Any = None,
) -> dict[str, jax.Array]:
    """Backward: ``{"x": d_x, "weight": d_weight}`` in their inputs' dtypes."""
    del eps, cfg
    x, weight, r = residuals
    n = x.astype(jnp.float32) * r
    dy = d_out.astype(jnp.float32)
    g = dy * weight.astype(jnp.float32)
    d_x = r * (g - n * jnp.mean(g * n, axis=-1, keepdims=True))
    d_weight = jnp.sum((dy * n).reshape(-1, x.shape[-1]), axis=0)
    return {"x": d_x.astype(x.dtype), "weight": d_weight.astype(weight.dtype)}


defvjp(example_rms_norm_example, _example_rms_norm_fwd, _example_rms_norm_bwd)


def _forward(x: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * r * weight.astype(jnp.float32)).astype(x.dtype), r
