"""example_rms_norm: RMS normalisation over the last axis, scaled per feature.

``out = x / sqrt(mean(x ** 2, axis=-1) + eps) * weight``, accumulated in float32, returned in
the dtype of ``x``. Differentiable in ``x`` and ``weight``.

A plugin's new op is a spec like core's (``ejkernel/specs/<op>.py``): signature, validation
that raises before any implementation runs, a plain-JAX reference written for clarity, the
conformance kit's examples, and a public function. Its name carries the plugin's prefix, so
it cannot collide with an op core adds later.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.ops import OpKernel
from ejkernel.specs import Arg, OpSpec

__all__ = [
    "SPEC",
    "ExampleRmsNorm",
    "example_rms_norm",
    "example_rms_norm_reference",
    "examples",
    "validate_example_rms_norm",
]

OP = "example_rms_norm"


def example_rms_norm_reference(x: jax.Array, weight: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """The oracle: float32 mean of squares, reciprocal square root, per-feature scale."""
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale * weight.astype(jnp.float32)).astype(x.dtype)


def validate_example_rms_norm(a: dict[str, Any]) -> dict[str, Any]:
    """Check ``x [..., D]``, ``weight [D]`` and ``eps``; raise ValueError/TypeError naming the
    argument (shapes and dtypes only: values may be traced)."""
    x, weight, eps = a["x"], a["weight"], a["eps"]
    for name, arr in (("x", x), ("weight", weight)):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{OP}: `{name}` must be an array; got {type(arr).__name__}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{OP}: `{name}` must be a floating array; got dtype {arr.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{OP}: `x` must be [..., D]; got x.shape={tuple(x.shape)}")
    if weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{OP}: `weight` must be [D] with D = x.shape[-1]; got weight.shape="
            f"{tuple(weight.shape)}, x.shape={tuple(x.shape)}"
        )
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"{OP}: `eps` must be a positive number; got {eps!r}")
    a["eps"] = float(eps)
    return a


def examples() -> list[Any]:
    """The conformance kit's cases: odd feature sizes, leading axes of any rank (imported by
    the kit only: ``OpSpec.examples`` names this function as a string)."""
    from ejkernel.testing import FLOAT, Example, Invalid

    return [
        Example(name="B2-S37-D80", arrays={"x": ((2, 37, 80), FLOAT), "weight": ((80,), FLOAT)}),
        Example(
            name="T129-D48-eps1e-2",
            arrays={"x": ((129, 48), FLOAT), "weight": ((48,), FLOAT)},
            options={"eps": 1e-2},
        ),
        Invalid.replace("weight-wrong-length", weight=lambda a: a["weight"][1:]),
        Invalid.replace("eps-negative", eps=-1.0),
        Invalid.replace("x-integer", x=lambda a: np.asarray(a["x"]).astype(np.int32)),
    ]


SPEC = OpSpec(
    name=OP,
    args=(
        Arg(name="x", array=True, required=True, differentiable=True),
        Arg(name="weight", array=True, required=True, differentiable=True),
        Arg(name="eps", array=False, default=1e-6),
    ),
    validate=validate_example_rms_norm,
    reference=example_rms_norm_reference,
    examples=f"{__name__}:examples",
)


class ExampleRmsNorm(OpKernel[Any, jax.Array]):
    """The op as a kernel: ``executor(ExampleRmsNorm(), x, weight, eps=...)``."""

    spec = SPEC


def example_rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float = 1e-6,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """RMS-normalise ``x`` over its last axis and scale each feature by ``weight``.

    Args:
        x: [..., D], floating.
        weight: [D].
        eps: added to the mean of squares (positive).
        platform: force an installed platform (``"example"``, ...).
        cfg: a config for the selected implementation (none here takes one).

    Returns:
        [..., D] in the dtype of ``x``. Differentiable in ``x`` and ``weight``.
    """
    return ExampleRmsNorm().run(x, weight, eps=eps, platform=platform, cfg=cfg)
