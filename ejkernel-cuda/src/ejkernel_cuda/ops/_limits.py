"""Limits the CUDA routes share: dtypes and head dims a kernel takes, as a reason to decline.

The cuDNN route's other limits (cuDNN version, GPU, sequence lengths, masks) are in
:mod:`ejkernel_cuda.ops._cudnn_limits`, which passes its head-dim limit for this GPU here.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

__all__ = ["declined_dtype_or_head_dims"]


def declined_dtype_or_head_dims(
    kernel: str, dtypes: tuple[str, ...], max_head_dim: int, query: Any, value: Any
) -> str | None:
    """Why ``kernel`` declines the query's dtype or the head dims (it needs ``Dv == D``, a
    multiple of 8 and at most ``max_head_dim``); ``None`` if it takes them."""
    dtype = str(jnp.dtype(query.dtype))
    if dtype not in dtypes:
        return f"{kernel} takes {'/'.join(dtypes)}; got {dtype}"
    d, dv = int(query.shape[-1]), int(value.shape[-1])
    if dv != d:
        return f"{kernel} needs Dv == D; got D={d}, Dv={dv}"
    if d % 8 or d > max_head_dim:
        return f"{kernel} needs a head dim <= {max_head_dim} and a multiple of 8; got D={d}"
    return None
