"""What cuDNN's fused attention computes, as JAX reaches it, per cuDNN version and GPU.

The cuDNN route calls ``jax.nn.dot_product_attention(..., implementation="cudnn")``, which
lowers to cuDNN's fused flash attention (``jax._src.cudnn.fused_attention_stablehlo``). JAX
checks some limits while it traces, others surface as cuDNN errors when XLA compiles; either
way the call fails after selection. :func:`cudnn_declines` states them all up front, so
``supports()`` declines with a reason and selection moves on to another platform. The rules
(docs/platforms.md has the table):

- a cuDNN that JAX finds, at least 8.9.4 (JAX's floor for flash attention); a GPU of compute
  capability 8.0 (Ampere) or later; compute capability 10.3 needs cuDNN 9.11;
- query, key and value of one dtype, bfloat16 or float16 (fp8 goes through another JAX entry
  point with scaling factors; float32 is not a cuDNN attention type);
- ``Dv == D`` (``jax.nn.dot_product_attention`` takes value heads of the key's size), ``D`` a
  multiple of 8, at most 256 on Hopper or later with cuDNN 9.5+, else at most 128;
- GQA/MQA (``Hkv < Hq``) from cuDNN 8.9.7;
- even sequence lengths: the backward pass JAX builds rejects an odd ``Sq`` or ``Sk``
  (``NotImplementedError: Unsupported sequence length Q 777, KV 777``; JAX passes a bias
  placeholder even without bias, so its "with bias" guard always applies). Selection cannot
  know whether a call will be differentiated (``jax.grad`` of a jitted function or of a
  ``scan`` body differentiates it after the op returned), so odd lengths are declined for the
  forward too; a single query (decode) is odd;
- ejkernel features cuDNN lacks or JAX does not map: logits soft cap, attention sinks,
  ejkernel's reproducible dropout, segment ids;
- masks: cuDNN's causal mask and sliding window are top-left aligned, ejkernel's bottom-right:
  causal needs ``Sq == Sk``, a window needs ``Sq == Sk`` and no right extent (``right == 0`` or
  causal).

The version and compute capability are read when ``supports()`` runs (never at import). When
JAX finds no cuDNN the route declines. When the compute capability cannot be read, the rules
are those of a pre-Hopper GPU (head dim at most 128), as JAX itself assumes then, and no
architecture rule declines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from ejkernel_cuda.ops._limits import declined_dtype_or_head_dims

__all__ = [
    "DTYPES",
    "CudnnTarget",
    "cudnn_declines",
    "current_target",
    "head_dim_limit",
    "version_string",
]

ROUTE = "cuDNN fused attention"
DTYPES = ("bfloat16", "float16")

#: cuDNN versions (``cudnnGetVersion()`` numbers) from which a feature exists.
MIN_VERSION = 8904  # flash attention through JAX
GQA_VERSION = 8907  # grouped-query attention (K/V heads < Q heads)
HEAD_DIM_256_VERSION = 90500  # head dims 129..256 on Hopper or later
CC_10_3_VERSION = 91100  # compute capability 10.3


class CudnnTarget(NamedTuple):
    """The cuDNN and GPU a call would run on."""

    #: ``cudnnGetVersion()`` as JAX reports it (``90800`` is 9.8.0), ``None`` without cuDNN.
    version: int | None
    #: ``(major, minor)`` compute capability, ``None`` when it cannot be read.
    cc: tuple[int, int] | None


def current_target() -> CudnnTarget:
    """This process's cuDNN version and default device's compute capability (never raises)."""
    from ejkernel_cuda import _device

    return CudnnTarget(version=_device.cudnn_version(), cc=_device.cc_tuple())


def version_string(version: int) -> str:
    """``90800`` -> ``"9.8.0"``, ``8904`` -> ``"8.9.4"`` (cuDNN 9 counts minors by 100)."""
    if version >= 10000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def head_dim_limit(target: CudnnTarget) -> int:
    """The largest head dim cuDNN's fused attention takes on ``target``."""
    hopper = target.cc is not None and target.cc >= (9, 0)
    return 256 if hopper and (target.version or 0) >= HEAD_DIM_256_VERSION else 128


def _platform_declines(target: CudnnTarget) -> str | None:
    version, cc = target.version, target.cc
    if version is None:
        return "JAX finds no cuDNN"
    if version < MIN_VERSION:
        return (
            f"{ROUTE} needs cuDNN >= {version_string(MIN_VERSION)}; "
            f"JAX finds {version_string(version)}"
        )
    if cc is not None and cc < (8, 0):
        return f"{ROUTE} needs compute capability >= 8.0 (Ampere); this GPU is {cc[0]}.{cc[1]}"
    if cc == (10, 3) and version < CC_10_3_VERSION:
        return (
            f"{ROUTE} on compute capability 10.3 needs cuDNN >= "
            f"{version_string(CC_10_3_VERSION)}; JAX finds {version_string(version)}"
        )
    return None


def _feature_declines(kw: Mapping[str, Any]) -> str | None:
    if kw.get("logits_soft_cap") is not None:
        return f"{ROUTE} has no logits soft cap"
    if kw.get("softmax_aux") is not None:
        return f"{ROUTE} has no attention sinks (softmax_aux)"
    if (kw.get("dropout_prob") or 0.0) > 0.0:
        return "cuDNN's dropout is not ejkernel's reproducible dropout"
    if kw.get("q_segment_ids") is not None or kw.get("kv_segment_ids") is not None:
        return "segment ids (packed sequences) are not mapped onto cuDNN"
    return None


def _mask_declines(kw: Mapping[str, Any], sq: int, sk: int) -> str | None:
    if kw.get("causal") and sq != sk:
        return (
            f"cuDNN's causal mask is top-left aligned, ejkernel's bottom-right: they agree only "
            f"for Sq == Sk; got Sq={sq}, Sk={sk}"
        )
    window = kw.get("sliding_window")
    if window is not None:
        if sq != sk:
            return f"a sliding window on cuDNN needs Sq == Sk; got Sq={sq}, Sk={sk}"
        if not kw.get("causal") and window[1] != 0:
            return f"cuDNN takes only left windows (right == 0, or causal); got {tuple(window)}"
    return None


def cudnn_declines(kw: Mapping[str, Any], target: CudnnTarget) -> str | None:
    """Why cuDNN's fused attention on ``target`` cannot compute this call with ejkernel's
    semantics, or ``None`` if it can.

    Args:
        kw: the op's validated keyword arguments (arrays or ``jax.ShapeDtypeStruct``).
        target: the cuDNN version and compute capability (:func:`current_target`).
    """
    declined = _platform_declines(target)
    if declined:
        return declined
    q, k, v = kw["query"], kw["key"], kw["value"]
    declined = declined_dtype_or_head_dims(ROUTE, DTYPES, head_dim_limit(target), q, v)
    if declined:
        return declined
    dtypes = {str(jnp.dtype(x.dtype)) for x in (q, k, v)}
    if len(dtypes) > 1:
        return f"{ROUTE} needs query, key and value of one dtype; got {', '.join(sorted(dtypes))}"
    hq, hkv = int(q.shape[2]), int(k.shape[2])
    if hkv != hq and (target.version or 0) < GQA_VERSION:
        return (
            f"{ROUTE} takes fewer K/V heads than Q heads (GQA) from cuDNN "
            f"{version_string(GQA_VERSION)}; got Hq={hq}, Hkv={hkv}"
        )
    declined = _feature_declines(kw)
    if declined:
        return declined
    sq, sk = int(q.shape[1]), int(k.shape[1])
    declined = _mask_declines(kw, sq, sk)
    if declined:
        return declined
    if sq % 2 or sk % 2:
        return (
            f"{ROUTE} needs even sequence lengths: JAX's cuDNN backward rejects an odd one "
            f"('Unsupported sequence length') and selection cannot tell whether the call will "
            f"be differentiated; got Sq={sq}, Sk={sk}"
        )
    return None
