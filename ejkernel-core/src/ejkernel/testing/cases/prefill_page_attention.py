"""Conformance examples of ``prefill_page_attention``: a chunk over partial pages, GQA, soft
cap and sliding window, float8 caches."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._paged import PagedBatch, invalid_scales

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        PagedBatch(
            kv_lens=(37,), q_lens=(5,), hq=6, hkv=2, d=80, page_size=8, max_pages=6, num_pages=16
        ).example("prefill", tags="chunk"),
        PagedBatch(
            kv_lens=(37,), q_lens=(37,), hq=4, hkv=1, d=64, page_size=4, max_pages=12, num_pages=16
        ).example(
            "prefill", tags="whole-softcap-window", logits_soft_cap=10.0, sliding_window=(9, 0)
        ),
        PagedBatch(
            kv_lens=(37,), q_lens=(5,), hq=6, hkv=2, d=80, page_size=8, max_pages=6, num_pages=16
        ).scaled_example("prefill"),
        Invalid.extra_axis("query"),
        Invalid.replace("page_indices-2d", page_indices=lambda a: a["page_indices"][None]),
        *invalid_scales(),
    ]
