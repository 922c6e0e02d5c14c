"""Conformance examples of ``unified_attention``: mixed prefill and decode, ALiBi, sinks,
non-causal with a two-sided window."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases.ragged_page_attention import invalid_packed, packed_example

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        packed_example(
            "mixed-alibi",
            hq=6,
            hkv=2,
            d=80,
            num_seqs=None,
            extra={"alibi_slopes": ((6,), "float32")},
        ),
        packed_example(
            "noncausal-window-sinks-softcap",
            hq=4,
            hkv=1,
            d=64,
            num_seqs=None,
            extra={"softmax_aux": ((4,), FLOAT)},
            causal=False,
            sliding_window=(6, 3),
            logits_soft_cap=10.0,
        ),
        *invalid_packed(),
    ]
