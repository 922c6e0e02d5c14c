"""Builders shared by the examples (and tests) of the paged-cache ops: hostile page tables
(pages in shuffled order, garbage ids past the live pages) and NaN in every cache slot no
sequence owns, so an implementation that reads what it must not fails loudly; float8 caches
read with ``k_scale``/``v_scale``, and the scale arguments every serving op must reject."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._paged import paged_block_tables
from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["FP8", "GARBAGE", "PagedBatch", "invalid_scales", "paged_fill"]

#: The scaled cache dtype of the serving ops (``k_scale``/``v_scale``).
FP8 = "float8_e4m3fn"

#: Table entries past a sequence's live pages: never read, so any value must be harmless.
GARBAGE = (10**6, -1)

#: Layouts of the paged ops' arguments: ``"packed"`` (``queries [T, Hq, D]`` and
#: ``query_start_loc``), ``"decode"`` (``query [S, Hq, D]``, one per sequence), ``"prefill"``
#: (one sequence: ``query [C, Hq, D]``, ``kv_len``, ``page_indices [P]``).
LAYOUTS = ("packed", "decode", "prefill")


@attrs.frozen(kw_only=True)
class PagedBatch:
    """The sizes of a paged batch; :meth:`example` turns it into an :class:`Example`.

    Attributes:
        kv_lens: tokens in the cache per sequence (after any update).
        q_lens: query tokens per sequence (its last tokens); ``None``: one per sequence.
        hq, hkv, d: query heads, KV heads, head dim.
        page_size, max_pages, num_pages: the paging (``max_pages`` is the table width).
        pad_tokens: packed tokens after the last sequence (they belong to none).
        shared_pages: the first live pages of each sequence (one count for all, or one per
            sequence) that are sequence 0's, a shared prefix.
    """

    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None
    hq: int
    hkv: int
    d: int
    page_size: int
    max_pages: int
    num_pages: int
    pad_tokens: int = 0
    shared_pages: int | tuple[int, ...] = 0

    @property
    def tokens(self) -> int:
        """Packed query tokens ``T`` (padding included)."""
        q_lens = self.q_lens if self.q_lens is not None else (1,) * len(self.kv_lens)
        return sum(q_lens) + self.pad_tokens

    def __str__(self) -> str:
        heads = f"Hq{self.hq}-Hkv{self.hkv}-D{self.d}-page{self.page_size}x{self.max_pages}"
        if self.q_lens is None:
            return f"S{len(self.kv_lens)}-{heads}"
        return f"S{len(self.kv_lens)}-T{self.tokens}-{heads}"

    def example(
        self,
        layout: str = "packed",
        *,
        tags: str = "",
        num_seqs: int | None = None,
        new_tokens: bool = False,
        unused: int | Sequence[int] = GARBAGE,
        extra: dict[str, tuple[tuple[int, ...], str]] | None = None,
        cache_dtype: str = FLOAT,
        **options: Any,
    ) -> Example:
        """The batch as an example of an op taking ``layout`` (one of :data:`LAYOUTS`).

        Args:
            layout: the op's argument layout.
            tags: appended to the name.
            num_seqs: a ``num_seqs`` argument (shape ``()``) with this many live sequences;
                ``None``: the op takes none.
            new_tokens: ``keys``/``values [T, Hkv, D]`` of the new tokens too (their cache
                slots hold NaN: the op must write them before attending).
            unused: table entries past the live pages.
            extra: more arrays, name -> ``(shape, dtype)`` (``k_scale``: ``((Hkv,),
                "float32")``).
            cache_dtype: the caches' dtype (:data:`FP8` with ``k_scale``/``v_scale``); default
                the case's.
            options: static arguments of the op (a float ``k_scale``/``v_scale`` too).
        """
        if layout not in LAYOUTS:
            raise ValueError(f"PagedBatch.example: layout must be one of {LAYOUTS}; got {layout!r}")
        s, t = len(self.kv_lens), self.tokens
        cache = (self.num_pages, self.page_size, self.hkv, self.d)
        if cache_dtype != FLOAT:
            tags = "-".join(t for t in (tags, "fp8" if cache_dtype == FP8 else cache_dtype) if t)
        if layout == "prefill":
            name = f"C{t}-kv{self.kv_lens[0]}-Hq{self.hq}-Hkv{self.hkv}-D{self.d}"
            name += f"-page{self.page_size}x{self.max_pages}"
            arrays = {
                "query": ((t, self.hq, self.d), FLOAT),
                "key_cache": (cache, cache_dtype),
                "value_cache": (cache, cache_dtype),
                "kv_len": ((), "int32"),
                "page_indices": ((self.max_pages,), "int32"),
            }
        else:
            name = str(self)
            query = "queries" if layout == "packed" else "query"
            arrays = {query: ((t, self.hq, self.d), FLOAT)}
            if new_tokens:
                arrays |= {"keys": ((t, self.hkv, self.d), FLOAT)}
                arrays |= {"values": ((t, self.hkv, self.d), FLOAT)}
            arrays |= {
                "key_cache": (cache, cache_dtype),
                "value_cache": (cache, cache_dtype),
                "kv_lens": ((s,), "int32"),
                "block_tables": ((s, self.max_pages), "int32"),
            }
            if layout == "packed":
                arrays["query_start_loc"] = ((s + 1,), "int32")
            if num_seqs is not None:
                arrays["num_seqs"] = ((), "int32")
        return Example(
            name=name + (f"-{tags}" if tags else ""),
            arrays={**arrays, **(extra or {})},
            options=options,
            fill=paged_fill(
                self.kv_lens,
                q_lens=self.q_lens if layout == "packed" else None,
                tables="page_indices" if layout == "prefill" else "block_tables",
                num_seqs=num_seqs,
                new_tokens=new_tokens,
                unused=unused,
                shared_pages=self.shared_pages,
            ),
        )

    def scaled_example(
        self, layout: str = "packed", *, tags: str = "head-k_scale", **kwargs: Any
    ) -> Example:
        """:meth:`example` over :data:`FP8` caches read with a per-KV-head ``k_scale [Hkv]``
        (float32) and a float ``v_scale`` of 0.75; ``kwargs`` as :meth:`example`'s."""
        return self.example(
            layout,
            tags=tags,
            cache_dtype=FP8,
            extra={"k_scale": ((self.hkv,), "float32")},
            v_scale=0.75,
            **kwargs,
        )


def invalid_scales(caches: tuple[str, str] = ("key_cache", "value_cache")) -> list[Invalid]:
    """Scale arguments every serving op rejects: ``k_scale`` ``[Hkv + 1]``, a bfloat16
    ``v_scale``, a negative float, and float8 caches (named by ``caches``) without scales."""
    key, value = caches

    def hkv(a: dict[str, Any]) -> int:
        return int(a[key].shape[2])

    return [
        Invalid.replace(
            "k_scale-wrong-shape", k_scale=lambda a: np.ones((hkv(a) + 1,), np.float32)
        ),
        Invalid.replace("v_scale-bfloat16", v_scale=lambda a: jnp.ones((hkv(a),), jnp.bfloat16)),
        Invalid.replace("k_scale-negative", k_scale=-0.5),
        Invalid.replace(
            "fp8-cache-without-scales",
            **{key: lambda a: a[key].astype(FP8), value: lambda a: a[value].astype(FP8)},
        ),
    ]


def paged_fill(
    kv_lens: Sequence[int],
    *,
    q_lens: Sequence[int] | None = None,
    tables: str = "block_tables",
    num_seqs: int | None = None,
    new_tokens: bool = False,
    unused: int | Sequence[int] = GARBAGE,
    shared_pages: int | Sequence[int] = 0,
) -> Callable[[dict[str, Any], np.random.Generator], dict[str, Any]]:
    """A ``fill`` setting lengths, tables (and ``query_start_loc`` from ``q_lens``) and NaN
    in the cache slots no sequence owns (with ``new_tokens``, the new tokens' slots too).

    The structure comes from a fixed seed, so every draw of an example shares it (``vmap``
    stacks draws).
    """

    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del rng
        structure = np.random.default_rng(0)
        num_pages, page_size = values["key_cache"].shape[:2]
        table = paged_block_tables(
            structure,
            kv_lens,
            num_pages=num_pages,
            page_size=page_size,
            max_pages=values[tables].shape[-1],
            unused=unused,
            shared_pages=shared_pages,
        )
        owned = np.zeros((num_pages, page_size), bool)
        for s, n in enumerate(kv_lens):
            old = n - q_lens[s] if new_tokens and q_lens is not None else n
            for pos in range(old):
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
