"""What the CUDA platform needs to know about the device: is it an NVIDIA GPU, its compute
capability and SM count, and whether cuDNN is there. Every probe is lazy and never raises."""

from __future__ import annotations

import functools
from typing import Any

import jax

__all__ = [
    "available",
    "cc_major",
    "cc_tuple",
    "compute_capability",
    "cudnn_version",
    "is_nvidia_gpu",
    "sm_count",
]


def _device() -> Any:
    return jax.devices()[0]


def is_nvidia_gpu() -> bool:
    """Whether JAX's default device is an NVIDIA GPU (CUDA, not ROCm)."""
    if jax.default_backend() != "gpu":
        return False
    return _nvidia(_device())


@functools.cache
def _nvidia_cached(platform_name: str, platform_version: str, has_cc: bool) -> bool:
    text = f"{platform_name} {platform_version}".lower()
    if "rocm" in text or "hip" in text:
        return False
    return "cuda" in text or has_cc


def _nvidia(dev: Any) -> bool:
    client = getattr(dev, "client", None)
    return _nvidia_cached(
        str(getattr(client, "platform_name", "")),
        str(getattr(client, "platform_version", "")),
        bool(getattr(dev, "compute_capability", None)),
    )


def available(backend: str) -> bool | str:
    """Availability probe of the ``cuda`` platform: ``True`` on an NVIDIA GPU, else a reason."""
    if backend != "gpu":
        return f"needs an NVIDIA GPU (this device is {backend})"
    if not is_nvidia_gpu():
        return "needs an NVIDIA GPU with CUDA (this GPU is not driven by CUDA)"
    return True


def compute_capability() -> str | None:
    """``"9.0"`` style compute capability of the default device, or ``None`` off NVIDIA GPUs."""
    if not is_nvidia_gpu():
        return None
    cc = getattr(_device(), "compute_capability", None)
    return str(cc) if cc else None


def cc_tuple() -> tuple[int, int] | None:
    """``(9, 0)`` style compute capability of the default device, or ``None`` when unknown."""
    cc = compute_capability()
    if not cc:
        return None
    try:
        major, _, minor = str(cc).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        return None


def cc_major() -> int:
    """Major compute capability (0 when unknown)."""
    cc = cc_tuple()
    return cc[0] if cc else 0


def sm_count() -> int:
    """Streaming multiprocessors of the default device (132 on an H100 SXM when unknown)."""
    count = getattr(_device(), "core_count", None) if is_nvidia_gpu() else None
    try:
        return max(int(count), 1) if count else 132
    except (TypeError, ValueError):
        return 132


@functools.cache
def cudnn_version() -> int | None:
    """cuDNN's version as JAX sees it (``90800`` for 9.8.0), or ``None`` without cuDNN.

    Asks the check JAX's own cuDNN attention runs before lowering, so what this says matches
    what ``jax.nn.dot_product_attention(implementation="cudnn")`` will find.
    """
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        return int(check_cudnn_version())
    except Exception:
        pass
    try:
        from jax._src.lib import cuda_versions
    except Exception:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:
        return None
