"""mean_pooling on CUDA: native forward and backward kernels, dense and packed.

- Forward (``csrc/mean_pooling.cu``): a CTA of 32 x 8 threads reduces one split of one
  sequence's token rows over 32 16-byte column vectors (four rows in flight per thread) into
  a float32 partial; a second kernel adds the splits and divides by the length (an empty
  sequence gives 0). A dense ``[B, S, D]`` input is B sequences of S rows of ``[B·S, D]``.
- Backward, its own kernel (not a JAX broadcast): token t of sequence n receives
  ``d_out[n] / length_n``, n found by a binary search of the offsets (a division for dense
  input); tokens outside ``[cu_seqlens[0], cu_seqlens[N])`` get zeros. Pure streaming writes.

Offsets are clipped to ``[0, T]`` before the launch. Splits per sequence come from the shape
(about four waves of CTAs, at least 64 rows per split); there is no config. ``supports()``
declines dtypes other than bfloat16/float16/float32, and every call when nvcc is missing or
the build failed (the reason carries the compiler's message).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.plugins import defvjp
from ejkernel_cuda import _build

__all__ = ["mean_pooling_cuda", "supports"]

DTYPES = ("bfloat16", "float16", "float32")
MIN_ROWS_PER_SPLIT = 64
MAX_SPLITS = 128


def supports(inv: Any) -> bool | str:
    dtype = str(jnp.dtype(inv.kwargs["x"].dtype))
    if dtype not in DTYPES:
        return f"the CUDA mean_pooling kernels take {'/'.join(DTYPES)}; got {dtype}"
    return _build.native_status()


def mean_pooling_cuda(*, cfg: Any = None, **args: Any) -> jax.Array:
    """Mean over each sequence's tokens: ``ejkernel.mean_pooling``'s arguments (``x`` dense
    [B, S, D] or packed [T, D] / [1, T, D] with ``cu_seqlens``) as keywords, validated by the
    core spec; ``cfg`` is unused (nothing to tune). Returns [B, D] or [N, D] in the dtype of
    ``x``; empty sequences give zero rows."""
    del cfg
    _build.require_native()
    tokens, offsets, uniform, num_seqs = _layout(**args)
    return _forward(tokens, offsets, uniform=uniform, num_seqs=num_seqs)


def _mean_pooling_fwd(**args: Any) -> tuple[jax.Array, dict[str, jax.Array | None]]:
    """Forward of :func:`mean_pooling_cuda`: ``(out, residuals)``; residuals are the inputs."""
    return mean_pooling_cuda(**args), {"x": args["x"], "cu_seqlens": args.get("cu_seqlens")}


def _mean_pooling_bwd(
    residuals: dict[str, jax.Array | None], d_out: jax.Array, **statics: Any
) -> dict[str, jax.Array]:
    """Backward of :func:`mean_pooling_cuda`: ``{"x": d_x}`` in the dtype of ``x``."""
    del statics
    x = residuals["x"]
    assert x is not None
    _build.require_native()
    tokens, offsets, uniform, _ = _layout(**residuals)
    d_tokens = _backward(
        d_out.astype(x.dtype), offsets, num_tokens=tokens.shape[0], uniform=uniform
    )
    return {"x": d_tokens.reshape(x.shape)}


defvjp(mean_pooling_cuda, _mean_pooling_fwd, _mean_pooling_bwd)


# --------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------


def _layout(
    x: jax.Array, cu_seqlens: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, int, int]:
    """``(tokens [T, D], offsets [N + 1] int32, uniform length or 0, N)``."""
    d = x.shape[-1]
    if cu_seqlens is None:
        b, s = (x.shape[0], x.shape[1]) if x.ndim == 3 else (1, x.shape[0])
        return x.reshape(b * s, d), jnp.zeros((2,), jnp.int32), int(s), int(b)
    tokens = x.reshape(-1, d)
    offsets = jnp.clip(cu_seqlens.astype(jnp.int32), 0, tokens.shape[0])
    return tokens, offsets, 0, int(cu_seqlens.shape[0]) - 1


def _splits(num_tokens: int, num_seqs: int, d: int, itemsize: int) -> int:
    from ejkernel_cuda._device import sm_count

    vec = 16 // itemsize if d % (16 // itemsize) == 0 else 1
    ctas = math.ceil(d / (32 * vec)) * num_seqs
    rows = max(num_tokens // max(num_seqs, 1), 1)
    splits = math.ceil(32 * sm_count() / max(ctas, 1))
    return max(1, min(splits, MAX_SPLITS, math.ceil(rows / MIN_ROWS_PER_SPLIT)))


@functools.partial(jax.jit, static_argnames=("uniform", "num_seqs"))
def _forward(tokens: jax.Array, offsets: jax.Array, *, uniform: int, num_seqs: int) -> jax.Array:
    num_tokens, d = tokens.shape
    if num_tokens == 0 or d == 0 or num_seqs == 0:
        return jnp.zeros((num_seqs, d), tokens.dtype)
    splits = _splits(num_tokens, num_seqs, d, tokens.dtype.itemsize)
    call = jax.ffi.ffi_call(
        "ejkernel_mean_pooling_fwd",
        (
            jax.ShapeDtypeStruct((num_seqs, d), tokens.dtype),
            jax.ShapeDtypeStruct((splits, num_seqs, d), jnp.float32),
        ),
        vmap_method="sequential",
    )
    out, _ = call(tokens, offsets, uniform_len=np.int64(uniform), num_splits=np.int64(splits))
    return out


@functools.partial(jax.jit, static_argnames=("num_tokens", "uniform"))
def _backward(d_out: jax.Array, offsets: jax.Array, *, num_tokens: int, uniform: int) -> jax.Array:
    num_seqs, d = d_out.shape
    if num_tokens == 0 or d == 0 or num_seqs == 0:
        return jnp.zeros((num_tokens, d), d_out.dtype)
    call = jax.ffi.ffi_call(
        "ejkernel_mean_pooling_bwd",
        jax.ShapeDtypeStruct((num_tokens, d), d_out.dtype),
        vmap_method="sequential",
    )
    return call(d_out, offsets, uniform_len=np.int64(uniform))
