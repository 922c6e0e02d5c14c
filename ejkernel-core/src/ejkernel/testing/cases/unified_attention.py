"""Conformance examples of ``unified_attention``: mixed prefill and decode, ALiBi, sinks,
non-causal with a two-sided window, float8 caches."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases.ragged_page_attention import MIXED, MQA, invalid_packed

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        MIXED.example(tags="mixed-alibi", extra={"alibi_slopes": ((6,), "float32")}),
        MQA.example(
            tags="noncausal-window-sinks-softcap",
            extra={"softmax_aux": ((4,), FLOAT)},
            causal=False,
            sliding_window=(6, 3),
            logits_soft_cap=10.0,
        ),
        MIXED.scaled_example(),
        *invalid_packed(),
    ]
