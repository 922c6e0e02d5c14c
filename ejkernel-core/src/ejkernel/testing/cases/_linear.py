"""Builders shared by the examples of the linear-attention ops (recurrent, gla, lightning,
kernel delta attention)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["PACKED", "invalid_linear", "linear_example", "packed"]

#: Uneven packed sequences over 70 tokens, one of a single token.
PACKED = (0, 13, 40, 41, 70)


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
    extra: dict[str, tuple[tuple[int, ...], str]],
    **kwargs: Any,
) -> Example:
    """An example with query/key [B, S, H, K], value [B, S, H, V] and ``extra`` arrays."""
    arrays = {
        "query": ((b, s, h, k), FLOAT),
        "key": ((b, s, h, k), FLOAT),
        "value": ((b, s, h, v), FLOAT),
        **extra,
    }
    return Example(name=f"B{b}-S{s}-H{h}-K{k}-V{v}-{tags}", arrays=arrays, **kwargs)


def invalid_linear() -> list[Invalid]:
    """Changes every linear-attention op must reject."""
    return [
        Invalid.extra_axis("query"),
        Invalid.replace("key-length-differs", key=lambda a: a["key"][:, 1:]),
    ]
