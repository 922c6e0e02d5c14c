"""Conformance examples of ``blocksparse_attention``: random block masks over partial last
blocks, combined with the attention masks and options."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._common import attention_example
from ejkernel.testing.cases.flash_attention import _segments, invalid_attention

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        attention_example(
            (2, 37, 129, 4, 2, 80),
            tags="block16x32-causal",
            extra={"block_mask": ((1, 4, 3, 5), "bool")},
            options={"block_size": (16, 32), "causal": True},
        ),
        attention_example(
            (1, 129, 37, 4, 1, 64, 48),
            tags="block32-masks-bias-segments-window-softcap",
            extra={
                "block_mask": ((1, 1, 5, 2), "bool"),
                "attention_mask": ((1, 4, 129, 37), "bool"),
                "bias": ((1, 1, 129, 37), FLOAT),
                "q_segment_ids": ((1, 129), "int32"),
                "kv_segment_ids": ((1, 37), "int32"),
            },
            options={"block_size": 32, "sliding_window": (40, 3), "logits_soft_cap": 15.0},
            fill=_segments,
        ),
        *invalid_attention(),
        Invalid.replace(
            "block-mask-wrong-block-count",
            block_mask=lambda a: a["block_mask"][..., :-1],
        ),
    ]
