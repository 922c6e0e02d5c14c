"""Conformance examples of ``ragged_page_attention_v3``: the new tokens written into their
pages (the updated caches are compared too), then ragged paged attention."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases.ragged_page_attention import invalid_packed, packed_example

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        packed_example("mixed", hq=6, hkv=2, d=80, num_seqs=7, new_tokens=True),
        packed_example(
            "5-live-sinks-softcap-window",
            hq=4,
            hkv=1,
            d=64,
            num_seqs=5,
            new_tokens=True,
            extra={"softmax_aux": ((4, 2), FLOAT)},
            logits_soft_cap=10.0,
            sliding_window=(6, 0),
        ),
        *invalid_packed(),
        Invalid.replace("keys-wrong-tokens", keys=lambda a: a["keys"][1:]),
    ]
