"""Builders shared by the examples of the attention ops."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example

__all__ = ["arrays_of", "attention_example", "segment_ids", "sizes_id"]


def arrays_of(
    sizes: Mapping[str, int], dtype: str = FLOAT, **shapes: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """:attr:`Example.arrays` entries from shapes in OPS.md letters: ``x="[B, S, I]"`` is
    ``(sizes["B"], sizes["S"], sizes["I"])`` of ``dtype``."""
    return {
        name: (tuple(sizes[letter] for letter in re.findall(r"\w+", letters)), dtype)
        for name, letters in shapes.items()
    }


def sizes_id(sizes: Mapping[str, int]) -> str:
    """A readable example name of ``sizes``: ``B2-S37-I24``."""
    return "-".join(f"{letter}{size}" for letter, size in sizes.items())


def segment_ids(rng: np.random.Generator, b: int, s: int, *, pad: int = 0) -> np.ndarray:
    """[b, s] int32 ids of two or three packed segments per row, the last ``pad`` entries
    negative (padding)."""
    ids = np.zeros((b, s), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, max(s - pad, 2)), size=2, replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(s), side="right")
        if pad:
            ids[row, s - pad :] = -1
    return ids


def attention_example(
    b: int,
    sq: int,
    sk: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    *,
    tags: str = "",
    extra: dict[str, tuple[tuple[int, ...], str]] | None = None,
    **kwargs: Any,
) -> Example:
    """An attention example with query/key/value of the given sizes (named like
    ``B2-Sq37-Sk37-Hq4-Hkv2-D80``), ``extra`` arrays, and :class:`Example` fields."""
    dv = d if dv is None else dv
    name = f"B{b}-Sq{sq}-Sk{sk}-Hq{hq}-Hkv{hkv}-D{d}" + (f"-Dv{dv}" if dv != d else "")
    arrays = {
        "query": ((b, sq, hq, d), FLOAT),
        "key": ((b, sk, hkv, d), FLOAT),
        "value": ((b, sk, hkv, dv), FLOAT),
        **(extra or {}),
    }
    return Example(name=name + (f"-{tags}" if tags else ""), arrays=arrays, **kwargs)
