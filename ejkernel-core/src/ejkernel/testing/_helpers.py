"""Test helpers shared by every backend's tests: shape tables, inputs, one ``assert_close``.

Shapes always include the odd sizes (sequence 37 and 129, head dim 80, GQA/MQA).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ATTENTION_SHAPES",
    "TOLERANCES",
    "AttentionShape",
    "assert_close",
    "attention_inputs",
    "random_normal",
]

#: dtype -> (rtol, atol) for outputs and gradients compared with the float32 reference.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "bfloat16": (1e-2, 1e-2),
    "float16": (5e-3, 5e-3),
}


@attrs.frozen(kw_only=True)
class AttentionShape:
    """One attention problem size; ``str()`` is a readable test id."""

    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    dv: int | None = None

    def __str__(self) -> str:
        dv = "" if self.dv in (None, self.d) else f"-Dv{self.dv}"
        return f"B{self.b}-Sq{self.sq}-Sk{self.sk}-Hq{self.hq}-Hkv{self.hkv}-D{self.d}{dv}"


ATTENTION_SHAPES: tuple[AttentionShape, ...] = (
    AttentionShape(b=2, sq=37, sk=37, hq=4, hkv=4, d=80),
    AttentionShape(b=1, sq=129, sk=129, hq=8, hkv=2, d=64),
    AttentionShape(b=2, sq=37, sk=129, hq=6, hkv=1, d=32),
    AttentionShape(b=1, sq=129, sk=37, hq=4, hkv=2, d=80, dv=48),
    AttentionShape(b=1, sq=1, sk=129, hq=8, hkv=2, d=64),
)


def random_normal(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Standard normal values (never zeros) in ``dtype``."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def attention_inputs(
    shape: AttentionShape, dtype: Any = jnp.float32, seed: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``query, key, value`` for ``shape`` from a fixed key."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    dv = shape.dv or shape.d
    return (
        random_normal(kq, (shape.b, shape.sq, shape.hq, shape.d), dtype),
        random_normal(kk, (shape.b, shape.sk, shape.hkv, shape.d), dtype),
        random_normal(kv, (shape.b, shape.sk, shape.hkv, dv), dtype),
    )


def _leaves(x: Any) -> Iterator[Any]:
    yield from jax.tree_util.tree_leaves(x)


def assert_close(
    actual: Any,
    expected: Any,
    *,
    dtype: Any = None,
    scale: float = 1.0,
    name: str = "",
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Compare pytrees with the per-dtype tolerance table (``scale`` widens it).

    The tolerance applies relative to the largest magnitude of ``expected`` as well, so
    near-zero entries of long reductions do not fail spuriously (the largest finite
    magnitude); NaN passes only where ``expected`` is NaN too (a cache slot nobody owns).

    Args:
        actual: the pytree under test.
        expected: the reference pytree (same structure).
        dtype: the dtype whose tolerance applies; default each leaf's own.
        scale: multiplies the tolerance.
        name: named in failure messages.
        rtol: replaces the table's relative tolerance (before ``scale``).
        atol: replaces the table's absolute tolerance (before ``scale``).
    """
    for a, e in zip(_leaves(actual), _leaves(expected), strict=True):
        a32 = np.asarray(jnp.asarray(a, jnp.float32))
        e32 = np.asarray(jnp.asarray(e, jnp.float32))
        assert a32.shape == e32.shape, f"{name}: shape {a32.shape} != {e32.shape}"
        key = str(jnp.dtype(dtype if dtype is not None else a.dtype))
        table_rtol, table_atol = TOLERANCES.get(key, TOLERANCES["float32"])
        r = (table_rtol if rtol is None else rtol) * scale
        t = (table_atol if atol is None else atol) * scale
        assert np.all(np.isfinite(a32) | ~np.isfinite(e32)), f"{name}: non-finite values"
        finite = np.abs(e32[np.isfinite(e32)])
        peak = float(np.max(finite)) if finite.size else 0.0
        np.testing.assert_allclose(a32, e32, rtol=r, atol=t + r * peak, err_msg=name)
