"""Builders shared by the examples of the linear-attention ops (recurrent, gla, lightning,
kernel delta attention)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of

__all__ = [
    "PACKED",
    "invalid_linear",
    "linear_example",
    "packed",
    "packed_as",
    "packed_example",
]

#: Uneven packed sequences over 70 tokens, one of a single token.
PACKED = (0, 13, 40, 41, 70)


def packed(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """``cu_seqlens`` = :data:`PACKED` (the spec's synthetic spreads them evenly)."""
    del values, rng
    return {"cu_seqlens": np.asarray(PACKED, np.int32)}


def packed_as(offsets: tuple[int, ...]) -> Any:
    """A ``fill`` setting ``cu_seqlens`` to ``offsets``."""
    return lambda values, rng: {"cu_seqlens": np.asarray(offsets, np.int32)}


def linear_example(
    *,
    tags: str,
    extra: dict[str, str],
    b: int = 2,
    s: int = 37,
    h: int = 3,
    k: int = 16,
    v: int = 24,
    packed_sequences: bool | tuple[int, ...] = False,
    **kwargs: Any,
) -> Example:
    """An example with query/key [B, S, H, K], value [B, S, H, V] and ``extra`` floating
    arrays, each given by its shape in OPS.md letters (``"[B, S, H, K]"``; ``N`` is the number
    of sequences). The sizes default to an odd length; ``packed_sequences``: B = 1 and the
    tokens cut as :data:`PACKED`, or as the offsets given (``cu_seqlens`` is added)."""
    offsets = PACKED if packed_sequences is True else packed_sequences or ()
    if packed_sequences:
        b, s = 1, offsets[-1]
    n = len(offsets) - 1 if packed_sequences else b
    sizes = {"B": b, "S": s, "H": h, "K": k, "V": v, "N": n}
    arrays = arrays_of(
        sizes, query="[B, S, H, K]", key="[B, S, H, K]", value="[B, S, H, V]", **extra
    )
    if packed_sequences:
        arrays["cu_seqlens"] = ((n + 1,), "int32")
        kwargs["fill"] = packed if offsets == PACKED else packed_as(offsets)
    return Example(name=f"B{b}-S{s}-H{h}-K{k}-V{v}-{tags}", arrays=arrays, **kwargs)


def packed_example(*, tags: str, extra: dict[str, str], h: int = 2, **kwargs: Any) -> Example:
    """:func:`linear_example` of sequences packed as :data:`PACKED`, at K 32 and V 16."""
    return linear_example(tags=tags, extra=extra, h=h, k=32, v=16, packed_sequences=True, **kwargs)


def invalid_linear() -> list[Invalid]:
    """Changes every linear-attention op must reject."""
    return [
        Invalid.extra_axis("query"),
        Invalid.replace("key-length-differs", key=lambda a: a["key"][:, 1:]),
    ]
