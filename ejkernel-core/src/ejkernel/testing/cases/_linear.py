"""Builders shared by the examples of the linear-attention ops (recurrent, gla, lightning,
kernel delta attention)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of

__all__ = ["ODD", "PACKED", "invalid_linear", "linear_example", "packed"]

#: Uneven packed sequences over 70 tokens, one of a single token.
PACKED = (0, 13, 40, 41, 70)

#: ``(B, S, H, K, V)`` of the odd-length example every linear-attention op runs.
ODD = (2, 37, 3, 16, 24)


def packed(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """``cu_seqlens`` = :data:`PACKED` (the spec's synthetic spreads them evenly)."""
    del values, rng
    return {"cu_seqlens": np.asarray(PACKED, np.int32)}


def linear_example(
    b: int,
    s: int,
    h: int,
    k: int,
    v: int,
    *,
    tags: str,
    extra: dict[str, str],
    packed_sequences: bool = False,
    **kwargs: Any,
) -> Example:
    """An example with query/key [B, S, H, K], value [B, S, H, V] and ``extra`` floating
    arrays, each given by its shape in OPS.md letters (``"[B, S, H, K]"``; ``N`` is the number
    of sequences). ``packed_sequences``: B == 1 and S tokens cut as :data:`PACKED`
    (``cu_seqlens`` is added)."""
    n = len(PACKED) - 1 if packed_sequences else b
    sizes = {"B": b, "S": s, "H": h, "K": k, "V": v, "N": n}
    arrays = arrays_of(
        sizes, query="[B, S, H, K]", key="[B, S, H, K]", value="[B, S, H, V]", **extra
    )
    if packed_sequences:
        assert b == 1 and s == PACKED[-1]
        arrays["cu_seqlens"] = ((n + 1,), "int32")
        kwargs["fill"] = packed
    return Example(name=f"B{b}-S{s}-H{h}-K{k}-V{v}-{tags}", arrays=arrays, **kwargs)


def invalid_linear() -> list[Invalid]:
    """Changes every linear-attention op must reject."""
    return [
        Invalid.extra_axis("query"),
        Invalid.replace("key-length-differs", key=lambda a: a["key"][:, 1:]),
    ]
