"""Entry point of the XLA plugin: registers every op in pure JAX (imports nothing heavy).

Op ``x`` lives in ``ejkernel_xla.ops.x``, registered with ``registry.register_module``: core
finds ``x_xla``, its config class, ``heuristic`` and ``config_space`` there by name on first
use. It declines no valid call (it is every op's fallback). Flash attention's module
also serves ``scaled_dot_product_attention`` (core's ``served_by``).
"""

from __future__ import annotations

from typing import Any

from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

#: Every op this plugin implements, each in ``ejkernel_xla.ops.<op>``.
OPS: tuple[str, ...] = (
    "flash_attention",
    "ring_attention",
    "native_sparse_attention",
    "attention",
    "blocksparse_attention",
    "multi_head_latent_attention",
    "page_attention",
    "ragged_decode_attention",
    "ragged_page_attention",
    "ragged_page_attention_v3",
    "prefill_page_attention",
    "unified_attention",
    "grouped_matmul",
    "mean_pooling",
    "recurrent",
    "gla",
    "lightning_attention",
    "kernel_delta_attention",
    "state_space_v1",
    "state_space_v2",
)


@hookimpl
def ejkernel_api_version() -> int:
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    registry.add_platform("xla", distribution="ejkernel-xla")
    registry.add_shipped_table("ejkernel_xla:shipped")
    for op in OPS:
        registry.register_module(op, f"ejkernel_xla.ops.{op}", platform="xla", backend="any")
