"""Builders shared by the examples of the paged-cache ops: hostile page tables (pages in
shuffled order, garbage ids past the live pages) and NaN in every cache slot no sequence owns,
so an implementation that reads what it must not fails loudly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ejkernel.specs._paged import paged_block_tables

__all__ = ["GARBAGE", "paged_fill"]

#: Table entries past a sequence's live pages: never read, so any value must be harmless.
GARBAGE = (10**6, -1)


def paged_fill(
    kv_lens: Sequence[int],
    *,
    q_lens: Sequence[int] | None = None,
    pad_tokens: int = 0,
    tables: str = "block_tables",
    num_seqs: int | None = None,
) -> Callable[[dict[str, Any], np.random.Generator], dict[str, Any]]:
    """A ``fill`` setting lengths, tables (and ``query_start_loc`` from ``q_lens``) and NaN
    in the cache slots no sequence owns.

    The structure comes from a fixed seed, so every draw of an example shares it (``vmap``
    stacks draws).
    """

    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del rng
        structure = np.random.default_rng(0)
        num_pages, page_size = values["key_cache"].shape[:2]
        max_pages = values[tables].shape[-1]
        table = paged_block_tables(
            structure,
            kv_lens,
            num_pages=num_pages,
            page_size=page_size,
            max_pages=max_pages,
            unused=GARBAGE,
        )
        owned = np.zeros((num_pages, page_size), bool)
        for s, n in enumerate(kv_lens):
            for pos in range(n):
                owned[table[s, pos // page_size], pos % page_size] = True
        out: dict[str, Any] = {}
        for name in ("key_cache", "value_cache"):
            cache = np.asarray(values[name], np.float32).copy()
            cache[~owned] = np.nan
            out[name] = cache
        if tables == "page_indices":
            out["page_indices"] = table[0]
            out["kv_len"] = np.asarray(kv_lens[0], np.int32).reshape(values["kv_len"].shape)
            return out
        out["block_tables"] = table
        out["kv_lens"] = np.asarray(kv_lens, np.int32)
        if q_lens is not None:
            out["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        if num_seqs is not None:
            out["num_seqs"] = np.asarray(num_seqs, np.int32).reshape(values["num_seqs"].shape)
        return out

    return fill
