"""Conformance examples of ``ragged_page_attention``: mixed prefill and decode with empty and
one-token sequences, more queries than keys, padding tokens, fewer live sequences than rows,
sinks, soft cap and sliding window."""

from __future__ import annotations

from typing import Any

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._paged import paged_fill

__all__ = ["examples", "packed_example"]

#: Lengths 0 and 1, whole pages, a chunked prefill (5 of 37), decode steps, a sequence with
#: more queries than keys (4 queries, 2 keys), 3 padding tokens.
KV_LENS = (37, 0, 1, 8, 19, 5, 2)
Q_LENS = (5, 0, 1, 8, 19, 1, 4)


def packed_example(
    tags: str,
    *,
    hq: int,
    hkv: int,
    d: int,
    num_seqs: int | None,
    new_tokens: bool = False,
    extra: dict[str, tuple[tuple[int, ...], str]] | None = None,
    **options: Any,
) -> Example:
    """A packed paged batch of :data:`KV_LENS` / :data:`Q_LENS` with 3 padding tokens
    (``num_seqs`` live sequences, ``None``: the op takes no ``num_seqs``; ``new_tokens``:
    keys/values of the new tokens too)."""
    t, s, page, pages, max_pages = sum(Q_LENS) + 3, len(KV_LENS), 4, 64, 11
    arrays: dict[str, tuple[tuple[int, ...], str]] = {"queries": ((t, hq, d), FLOAT)}
    if new_tokens:
        arrays |= {"keys": ((t, hkv, d), FLOAT), "values": ((t, hkv, d), FLOAT)}
    arrays |= {
        "key_cache": ((pages, page, hkv, d), FLOAT),
        "value_cache": ((pages, page, hkv, d), FLOAT),
        "kv_lens": ((s,), "int32"),
        "block_tables": ((s, max_pages), "int32"),
        "query_start_loc": ((s + 1,), "int32"),
        **(extra or {}),
    }
    if num_seqs is not None:
        arrays["num_seqs"] = ((), "int32")
    return Example(
        name=f"S{s}-T{t}-Hq{hq}-Hkv{hkv}-D{d}-page{page}x{max_pages}-{tags}",
        arrays=arrays,
        options=options,
        fill=paged_fill(KV_LENS, q_lens=Q_LENS, num_seqs=num_seqs),
    )


def invalid_packed() -> list[Invalid]:
    return [
        Invalid.extra_axis("queries"),
        Invalid.replace("kv_lens-wrong-length", kv_lens=lambda a: a["kv_lens"][1:]),
    ]


def examples() -> list[Example | Invalid]:
    return [
        packed_example("mixed", hq=6, hkv=2, d=80, num_seqs=7),
        packed_example(
            "5-live-sinks-softcap-window",
            hq=4,
            hkv=1,
            d=64,
            num_seqs=5,
            extra={"softmax_aux": ((4,), FLOAT)},
            logits_soft_cap=10.0,
            sliding_window=(6, 0),
        ),
        *invalid_packed(),
    ]
