"""Entry point of the CUDA plugin: registers the ``cuda`` platform (imports nothing heavy).

Two routes, one platform:

- vendor: ``flash_attention`` and ``scaled_dot_product_attention`` through cuDNN's fused
  attention, reached through XLA (``ejkernel_cuda.ops.flash_attention``);
- native: CUDA C++ kernels over the XLA FFI (``ragged_decode_attention``, ``page_attention``,
  ``mean_pooling``), built with nvcc on first use (``ejkernel_cuda._build``).

The platform is available on NVIDIA GPUs (``ejkernel_cuda._device:available``). Each
implementation's ``supports()`` declines, with the reason, what it cannot run: shapes and
features outside cuDNN's, and for the native kernels a missing nvcc or a failed build (the
compiler's message). Priorities sit above the XLA fallback, so a GPU picks this platform
where it can run; the native decode kernels sit below the Triton serving kernels, which read
the cache faster at large batches and long contexts (``benchmarks/RESULTS.md``), and lead
where ejkernel-triton is not installed or a shipped table measured them faster. ``ejkernel build cuda`` builds the native kernels ahead of time through
:func:`ejkernel_build`.
"""

from __future__ import annotations

from typing import Any

from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

PLATFORM = "cuda"

#: Priority of the CUDA implementations (the XLA fallback registers 0).
PRIORITY = 200

#: Priority of the native decode kernels: above the XLA fallback, below the Triton plugin's
#: serving kernels (20).
DECODE_PRIORITY = 10
DECODE_OPS = frozenset({"ragged_decode_attention", "page_attention"})

#: Every op this plugin implements, each in ``ejkernel_cuda.ops.<op>``, registered with
#: ``registry.register_module`` (core finds ``<op>_cuda``, its config class if any,
#: ``heuristic``, ``config_space`` and ``supports`` there by name on first use).
#: ``scaled_dot_product_attention`` has its own module, so flash attention's does not serve it
#: here (core's ``served_by`` applies only where a platform registers none).
OPS: tuple[str, ...] = (
    "flash_attention",
    "scaled_dot_product_attention",
    "ragged_decode_attention",
    "page_attention",
    "mean_pooling",
)


@hookimpl
def ejkernel_api_version() -> int:
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    registry.add_platform(
        PLATFORM, available="ejkernel_cuda._device:available", distribution="ejkernel-cuda"
    )
    registry.add_shipped_table("ejkernel_cuda:shipped")
    for op in OPS:
        priority = DECODE_PRIORITY if op in DECODE_OPS else PRIORITY
        registry.register_module(
            op, f"ejkernel_cuda.ops.{op}", platform=PLATFORM, backend="gpu", priority=priority
        )


@hookimpl
def ejkernel_build(platform: str, force: bool, check: bool, target: str | None) -> str | None:
    """``ejkernel build cuda``: compile the native kernels now (or report their state)."""
    if platform != PLATFORM:
        return None
    from ejkernel_cuda import _build

    if check:
        return f"cuda native kernels: {_build.status(arch=target)}"
    library = _build.build(arch=target, force=force)
    return f"cuda native kernels built: {library}"
