"""Builders shared by the examples of the attention ops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ejkernel.specs._base import letter_shape
from ejkernel.testing._examples import FLOAT, Example

__all__ = [
    "arrays_of",
    "attention_example",
    "heads_id",
    "segment_ids",
    "sizes_id",
    "tagged",
]


def arrays_of(
    sizes: Mapping[str, int], dtype: str = FLOAT, **shapes: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """:attr:`Example.arrays` entries from shapes in OPS.md letters: ``x="[B, S, I]"`` is
    ``(sizes["B"], sizes["S"], sizes["I"])`` of ``dtype``."""
    return {name: (letter_shape(letters, sizes), dtype) for name, letters in shapes.items()}


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


def heads_id(hq: int, hkv: int, d: int, dv: int) -> str:
    """The heads part of an attention example's name: ``Hq4-Hkv2-D80`` (``-Dv48`` when
    ``dv`` differs)."""
    return f"Hq{hq}-Hkv{hkv}-D{d}" + (f"-Dv{dv}" if dv != d else "")


def tagged(name: str, tags: str) -> str:
    """``name`` with ``tags`` appended (when any)."""
    return name + (f"-{tags}" if tags else "")


def attention_example(
    sizes: tuple[int, ...],
    *,
    tags: str = "",
    extra: dict[str, tuple[tuple[int, ...], str]] | None = None,
    **kwargs: Any,
) -> Example:
    """An attention example with query/key/value of ``sizes`` ``(B, Sq, Sk, Hq, Hkv, D)`` or
    ``(..., D, Dv)`` (named like ``B2-Sq37-Sk37-Hq4-Hkv2-D80``), ``extra`` arrays, and
    :class:`Example` fields."""
    b, sq, sk, hq, hkv, d = sizes[:6]
    dv = sizes[6] if len(sizes) > 6 else d
    arrays = {
        "query": ((b, sq, hq, d), FLOAT),
        "key": ((b, sk, hkv, d), FLOAT),
        "value": ((b, sk, hkv, dv), FLOAT),
        **(extra or {}),
    }
    name = f"B{b}-Sq{sq}-Sk{sk}-" + heads_id(hq, hkv, d, dv)
    return Example(name=tagged(name, tags), arrays=arrays, **kwargs)
