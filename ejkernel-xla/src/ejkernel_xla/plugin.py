"""Entry point of the XLA plugin: registers every op in pure JAX (imports nothing heavy)."""

from __future__ import annotations

from typing import Any

from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

_FLASH = "ejkernel_xla.ops.flash_attention"


@hookimpl
def ejkernel_api_version() -> int:
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    registry.add_platform("xla", distribution="ejkernel-xla")
    registry.register(
        "flash_attention",
        platform="xla",
        backend="any",
        priority=0,
        config=f"{_FLASH}:FlashAttentionConfig",
        heuristic=f"{_FLASH}:heuristic",
        config_space=f"{_FLASH}:config_space",
        supports=f"{_FLASH}:supports",
    )(f"{_FLASH}:flash_attention_xla")
    registry.register(
        "scaled_dot_product_attention",
        platform="xla",
        backend="any",
        priority=0,
        config=f"{_FLASH}:FlashAttentionConfig",
        heuristic=f"{_FLASH}:heuristic",
        config_space=f"{_FLASH}:config_space",
        supports=f"{_FLASH}:supports",
    )(f"{_FLASH}:scaled_dot_product_attention_xla")
