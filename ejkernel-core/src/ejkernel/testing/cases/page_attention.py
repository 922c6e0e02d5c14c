"""Conformance examples of ``page_attention``: an empty sequence, partial and full pages,
GQA/MQA, soft cap and sliding window, float8 caches."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._paged import PagedBatch, invalid_scales

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        PagedBatch(
            kv_lens=(37, 0, 1, 16, 29), hq=6, hkv=2, d=80, page_size=8, max_pages=5, num_pages=24
        ).example("decode", tags="empty-partial-full"),
        PagedBatch(
            kv_lens=(129, 3, 64), hq=4, hkv=1, d=64, page_size=16, max_pages=9, num_pages=20
        ).example(
            "decode", tags="mqa-softcap-window", logits_soft_cap=10.0, sliding_window=(20, 0)
        ),
        PagedBatch(
            kv_lens=(37, 0, 1, 16, 29), hq=6, hkv=2, d=80, page_size=8, max_pages=5, num_pages=24
        ).scaled_example("decode", tags="head-k_scale-window", sliding_window=(9, 0)),
        Invalid.extra_axis("query"),
        Invalid.replace("kv_lens-wrong-length", kv_lens=lambda a: a["kv_lens"][1:]),
        *invalid_scales(),
    ]
