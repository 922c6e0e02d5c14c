"""Entry point of the Triton plugin: registers its ops (:data:`OPS`); imports nothing heavy.

``ejkernel_triton.ops.flash_attention`` is registered with ``registry.register_module`` (core
finds ``flash_attention_triton``, ``FlashAttentionConfig``, ``heuristic``, ``config_space`` and
``supports`` there by name on first use); it also serves ``scaled_dot_product_attention``
(core's ``served_by``). The serving ops (``unified_attention``, ``ragged_page_attention``,
``page_attention``, ``prefill_page_attention``, ``ragged_decode_attention``,
``ragged_page_attention_v3``) share one kernel
(``ejkernel_triton.ops.unified_attention``); each op's module maps its arguments onto it. On
an NVIDIA GPU they come before the CUDA plugin's native decode kernels (priority 10) unless a
shipped table measured those faster.

The platform is available on a CUDA or ROCm GPU when jax-triton imports, and on a CPU when
``EJKERNEL_INTERPRET=1`` asks for Triton's interpreter; otherwise ``ejkernel info`` and every
selection record show :func:`available`'s reason.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ejkernel import env
from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

#: Above the XLA fallback (0): where Triton runs, it is the faster choice.
PRIORITY = 20

#: Every op this plugin implements, each in ``ejkernel_triton.ops.<op>``.
OPS: tuple[str, ...] = (
    "flash_attention",
    "gla",
    "kernel_delta_attention",
    "recurrent",
    "lightning_attention",
    "blocksparse_attention",
    "mean_pooling",
    "multi_head_latent_attention",
    "native_sparse_attention",
    "unified_attention",
    "ragged_page_attention",
    "page_attention",
    "prefill_page_attention",
    "ragged_decode_attention",
    "ragged_page_attention_v3",
    "state_space_v1",
    "state_space_v2",
)

#: Ops registered below the XLA fallback, so they run only where asked for
#: (``platform="triton"``): none at present (an op whose kernels are not yet measured on a GPU
#: against the XLA fallback goes here).
OPT_IN: frozenset[str] = frozenset()
#: Below the XLA fallback (0).
OPT_IN_PRIORITY = -10


def available(backend: str) -> bool | str:
    """True where the kernels can run on ``backend``, else the reason."""
    if backend == "gpu":
        return _importable("jax_triton")
    if backend == "cpu":
        if not env.interpret():
            return (
                "runs on a CPU only through Triton's interpreter: set EJKERNEL_INTERPRET=1 "
                "(slow; for tests and debugging)"
            )
        return _importable("triton")
    return f"no Triton kernels for {backend}"


@functools.cache
def _importable(module: str) -> bool | str:
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or jax-triton refusing a CPU-only jaxlib
        return f"cannot import {module}: {type(err).__name__}: {err}"
    return True


@hookimpl
def ejkernel_api_version() -> int:
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    registry.add_platform("triton", available=available, distribution="ejkernel-triton")
    registry.add_shipped_table("ejkernel_triton:shipped")
    for op in OPS:
        registry.register_module(
            op,
            f"ejkernel_triton.ops.{op}",
            platform="triton",
            backend=("gpu", "cpu"),
            priority=OPT_IN_PRIORITY if op in OPT_IN else PRIORITY,
        )
