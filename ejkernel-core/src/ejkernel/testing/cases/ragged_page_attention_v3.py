"""Conformance examples of ``ragged_page_attention_v3``: the new tokens written into their
pages (their slots hold NaN before; the updated caches are compared too), then ragged paged
attention; float8 caches (the new tokens written quantised)."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases.ragged_page_attention import MIXED, MQA, invalid_packed

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        MIXED.example(tags="mixed", num_seqs=7, new_tokens=True),
        MQA.example(
            tags="5-live-sinks-softcap-window",
            num_seqs=5,
            new_tokens=True,
            extra={"softmax_aux": ((4, 2), FLOAT)},
            logits_soft_cap=10.0,
            sliding_window=(6, 0),
        ),
        MIXED.scaled_example(num_seqs=7, new_tokens=True),
        *invalid_packed(),
        Invalid.replace("keys-wrong-tokens", keys=lambda a: a["keys"][1:]),
    ]
