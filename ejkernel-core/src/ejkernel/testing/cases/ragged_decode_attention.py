"""Conformance examples of ``ragged_decode_attention``: empty and one-token ranges, ranges
that do not start at 0 or run past the cache, GQA/MQA, D ≠ Dv, sinks, soft cap and sliding
window, float8 caches. Every cache entry outside a row's valid range is NaN, so reading it
fails loudly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._common import heads_id, tagged
from ejkernel.testing.cases._paged import FP8, invalid_scales

__all__ = ["examples", "rows_example"]


def rows_example(
    starts: tuple[int, ...],
    ends: tuple[int, ...],
    *,
    sk: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    tags: str = "",
    extra: dict[str, tuple[tuple[int, ...], str]] | None = None,
    cache_dtype: str = FLOAT,
    **options: Any,
) -> Example:
    """One decode query per row over ``[start, end)`` of a dense ``[B, Sk, Hkv, ·]`` cache
    (in ``cache_dtype``: :data:`~ejkernel.testing.cases._paged.FP8` with scales)."""
    b, dv = len(starts), d if dv is None else dv
    return Example(
        name=tagged(f"B{b}-Sk{sk}-" + heads_id(hq, hkv, d, dv), tags),
        arrays={
            "query": ((b, hq, d), FLOAT),
            "key": ((b, sk, hkv, d), cache_dtype),
            "value": ((b, sk, hkv, dv), cache_dtype),
            "sequence_start": ((b,), "int32"),
            "sequence_end": ((b,), "int32"),
            **(extra or {}),
        },
        options=options,
        fill=_ranges(starts, ends),
    )


def _ranges(
    starts: tuple[int, ...], ends: tuple[int, ...]
) -> Callable[[dict[str, Any], np.random.Generator], dict[str, Any]]:
    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del rng
        pos = np.arange(values["key"].shape[1])
        outside = (pos < np.asarray(starts)[:, None]) | (pos >= np.asarray(ends)[:, None])
        out: dict[str, Any] = {
            "sequence_start": np.asarray(starts, np.int32),
            "sequence_end": np.asarray(ends, np.int32),
        }
        for name in ("key", "value"):
            cache = np.asarray(values[name], np.float32).copy()
            cache[outside] = np.nan
            out[name] = cache
        return out

    return fill


def examples() -> list[Example | Invalid]:
    return [
        rows_example((0, 5, 20, 128), (37, 5, 129, 129), sk=129, hq=8, hkv=2, d=80, tags="ranges"),
        rows_example(
            (0, 3, 30),
            (37, 30, 31),
            sk=37,
            hq=4,
            hkv=1,
            d=64,
            dv=48,
            tags="sinks-softcap-window",
            extra={"softmax_aux": ((4,), FLOAT)},
            logits_soft_cap=10.0,
            sliding_window=(11, 0),
        ),
        rows_example(
            (0, 5, 20),
            (37, 30, 37),
            sk=37,
            hq=8,
            hkv=2,
            d=80,
            tags="fp8-head-k_scale-window",
            extra={"k_scale": ((2,), "float32")},
            cache_dtype=FP8,
            v_scale=0.75,
            sliding_window=(11, 0),
        ),
        Invalid.extra_axis("query"),
        Invalid.replace("sequence_end-wrong-length", sequence_end=lambda a: a["sequence_end"][1:]),
        *invalid_scales(("key", "value")),
    ]
