"""What the Pallas TPU paged-attention tests share: a batch's arguments as the core hands
them to an implementation, and the check of an implementation's output against the op's
reference (shape, dtype, no hidden NaN reaching a row, closeness)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ejkernel.specs import OpSpec
from ejkernel.testing import assert_close


def validated(spec: OpSpec, arrays: dict[str, Any], **options: Any) -> dict[str, Any]:
    """``arrays`` and ``options`` bound and validated by ``spec``."""
    return spec.validate(spec.bind((), {**arrays, **options}))


def check_output(
    impl: Callable[..., Any],
    spec: OpSpec,
    args: dict[str, Any],
    *,
    query: str,
    dtype: str,
    cfg: Any,
    name: str,
) -> Any:
    """``impl(**args, cfg=cfg)``: shaped as the argument ``query``, in ``dtype``, finite, and
    close to ``spec``'s reference."""
    out = impl(**args, cfg=cfg)
    ref = spec.reference(**args)
    assert out.shape == args[query].shape and out.dtype == jnp.dtype(dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "a hidden NaN reached a row"
    assert_close(out, ref, name=name)
    return out
