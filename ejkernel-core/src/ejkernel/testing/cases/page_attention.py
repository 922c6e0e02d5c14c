"""Conformance examples of ``page_attention``: an empty sequence, partial and full pages,
GQA/MQA, soft cap and sliding window."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._paged import paged_fill

__all__ = ["examples"]


def _example(
    kv_lens: tuple[int, ...],
    hq: int,
    hkv: int,
    d: int,
    page: int,
    pages: int,
    max_pages: int,
    tags: str,
    **options: object,
) -> Example:
    s = len(kv_lens)
    return Example(
        name=f"S{s}-Hq{hq}-Hkv{hkv}-D{d}-page{page}x{max_pages}-{tags}",
        arrays={
            "query": ((s, hq, d), FLOAT),
            "key_cache": ((pages, page, hkv, d), FLOAT),
            "value_cache": ((pages, page, hkv, d), FLOAT),
            "kv_lens": ((s,), "int32"),
            "block_tables": ((s, max_pages), "int32"),
        },
        options=options,
        fill=paged_fill(kv_lens),
    )


def examples() -> list[Example | Invalid]:
    return [
        _example((37, 0, 1, 16, 29), 6, 2, 80, 8, 24, 5, "empty-partial-full"),
        _example(
            (129, 3, 64),
            4,
            1,
            64,
            16,
            20,
            9,
            "mqa-softcap-window",
            logits_soft_cap=10.0,
            sliding_window=(20, 0),
        ),
        Invalid.extra_axis("query"),
        Invalid.replace("kv_lens-wrong-length", kv_lens=lambda a: a["kv_lens"][1:]),
    ]
