"""Conformance examples of ``ragged_page_attention``: mixed prefill and decode with empty and
one-token sequences, more queries than keys, padding tokens, fewer live sequences than rows,
sinks, soft cap and sliding window; float8 caches with per-head and per-tensor scales."""

from __future__ import annotations

import attrs

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._paged import PagedBatch, invalid_scales

__all__ = ["MIXED", "MQA", "examples", "invalid_packed"]

#: Lengths 0 and 1, whole pages, a chunked prefill (5 of 37), decode steps, a sequence with
#: more queries than keys (4 queries, 2 keys), 3 padding tokens.
MIXED = PagedBatch(
    kv_lens=(37, 0, 1, 8, 19, 5, 2),
    q_lens=(5, 0, 1, 8, 19, 1, 4),
    hq=6,
    hkv=2,
    d=80,
    page_size=4,
    max_pages=11,
    num_pages=64,
    pad_tokens=3,
)


#: :data:`MIXED` with MQA heads and a head dim of 64.
MQA = attrs.evolve(MIXED, hq=4, hkv=1, d=64)


def invalid_packed() -> list[Invalid]:
    return [
        Invalid.extra_axis("queries"),
        Invalid.replace("kv_lens-wrong-length", kv_lens=lambda a: a["kv_lens"][1:]),
        *invalid_scales(),
    ]


def examples() -> list[Example | Invalid]:
    return [
        MIXED.example(tags="mixed", num_seqs=7),
        MQA.example(
            tags="5-live-sinks-softcap-window",
            num_seqs=5,
            extra={"softmax_aux": ((4,), FLOAT)},
            logits_soft_cap=10.0,
            sliding_window=(6, 0),
        ),
        MIXED.scaled_example(num_seqs=6),
        *invalid_packed(),
    ]
