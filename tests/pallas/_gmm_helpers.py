"""What the Pallas grouped-matmul tests (TPU and Mosaic GPU) share: a call's arguments as the
core hands them to an implementation."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ejkernel.specs.grouped_matmul import SPEC


def gmm_inputs(
    m: int, k: int, n: int, sizes: Any, dtype: str, seed: int = 0, **options: Any
) -> dict[str, Any]:
    """Validated arguments with normal ``lhs [M, K]`` and ``rhs`` (``[G, K, N]``, or ``[G, N,
    K]`` with ``transpose_rhs``), ``len(sizes)`` groups of the given sizes."""
    rng = np.random.default_rng(seed)
    g = len(sizes)
    rhs_shape = (g, n, k) if options.get("transpose_rhs") else (g, k, n)
    args = {
        "lhs": jnp.asarray(rng.normal(size=(m, k)), dtype),
        "rhs": jnp.asarray(rng.normal(size=rhs_shape), dtype),
        "group_sizes": jnp.asarray(sizes, jnp.int32),
        **options,
    }
    return SPEC.validate(SPEC.bind((), args))


def transposed_rhs_inputs(n: int, dtype: str) -> dict[str, Any]:
    """:func:`gmm_inputs` of M 129, K 64, groups (60, 0, 40, 29), ``rhs`` as ``[G, N, K]`` in
    ``dtype`` and a float32 output."""
    return gmm_inputs(
        129, 64, n, (60, 0, 40, 29), dtype, transpose_rhs=True, preferred_element_type="float32"
    )
