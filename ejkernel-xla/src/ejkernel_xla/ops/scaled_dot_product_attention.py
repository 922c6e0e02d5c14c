"""scaled_dot_product_attention on XLA: flash attention's blockwise kernel without dropout/sinks.

The kernel, its config, heuristic and backward live in :mod:`ejkernel_xla.ops.flash_attention`;
this module is the op's entry in the finding rule.
"""

from __future__ import annotations

from ejkernel_xla.ops.flash_attention import (
    FlashAttentionConfig,
    config_space,
    heuristic,
    scaled_dot_product_attention_xla,
    supports,
)

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "heuristic",
    "scaled_dot_product_attention_xla",
    "supports",
]
