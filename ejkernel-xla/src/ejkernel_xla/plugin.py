"""Entry point of the XLA plugin: registers every op in pure JAX (imports nothing heavy).

Convention: op ``x`` lives in ``ejkernel_xla.ops.x`` as ``x_xla`` with ``supports``; ops with a
config also define ``heuristic`` and ``config_space`` there, and the table names the config.
"""

from __future__ import annotations

from typing import Any

from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

#: op -> name of its config class in its module (None: the implementation takes no config).
OPS: dict[str, str | None] = {
    "flash_attention": "FlashAttentionConfig",
    "scaled_dot_product_attention": "FlashAttentionConfig",
    "ring_attention": "RingAttentionConfig",
    "native_sparse_attention": "NativeSparseAttentionConfig",
    "attention": None,
    "blocksparse_attention": None,
    "multi_head_latent_attention": "MultiHeadLatentAttentionConfig",
    "page_attention": "PageAttentionConfig",
    "ragged_decode_attention": "RaggedDecodeAttentionConfig",
    "ragged_page_attention": "RaggedPageAttentionConfig",
    "ragged_page_attention_v3": "RaggedPageAttentionV3Config",
    "prefill_page_attention": "PrefillPageAttentionConfig",
    "unified_attention": "UnifiedAttentionConfig",
    "grouped_matmul": "GroupedMatmulConfig",
    "mean_pooling": None,
    "recurrent": "RecurrentConfig",
    "gla": "GlaConfig",
    "lightning_attention": "LightningAttentionConfig",
    "kernel_delta_attention": "KernelDeltaAttentionConfig",
    "state_space_v1": "StateSpaceV1Config",
    "state_space_v2": "StateSpaceV2Config",
}


@hookimpl
def ejkernel_api_version() -> int:
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    registry.add_platform("xla", distribution="ejkernel-xla")
    for op, config in OPS.items():
        module = f"ejkernel_xla.ops.{op}"
        tuning: dict[str, str] = {}
        if config is not None:
            tuning = {
                "config": f"{module}:{config}",
                "heuristic": f"{module}:heuristic",
                "config_space": f"{module}:config_space",
            }
        registry.register(
            op, platform="xla", backend="any", priority=0, supports=f"{module}:supports", **tuning
        )(f"{module}:{op}_xla")
