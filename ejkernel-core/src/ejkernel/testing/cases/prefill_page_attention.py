"""Conformance examples of ``prefill_page_attention``: a chunk over partial pages, GQA, soft
cap and sliding window."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._paged import paged_fill

__all__ = ["examples"]


def _example(
    c: int,
    kv_len: int,
    hq: int,
    hkv: int,
    d: int,
    page: int,
    pages: int,
    p: int,
    tags: str,
    **options: object,
) -> Example:
    return Example(
        name=f"C{c}-kv{kv_len}-Hq{hq}-Hkv{hkv}-D{d}-page{page}x{p}-{tags}",
        arrays={
            "query": ((c, hq, d), FLOAT),
            "key_cache": ((pages, page, hkv, d), FLOAT),
            "value_cache": ((pages, page, hkv, d), FLOAT),
            "kv_len": ((), "int32"),
            "page_indices": ((p,), "int32"),
        },
        options=options,
        fill=paged_fill((kv_len,), tables="page_indices"),
    )


def examples() -> list[Example | Invalid]:
    return [
        _example(5, 37, 6, 2, 80, 8, 16, 6, "chunk"),
        _example(
            37,
            37,
            4,
            1,
            64,
            4,
            16,
            12,
            "whole-softcap-window",
            logits_soft_cap=10.0,
            sliding_window=(9, 0),
        ),
        Invalid.extra_axis("query"),
        Invalid.replace("page_indices-2d", page_indices=lambda a: a["page_indices"][None]),
    ]
