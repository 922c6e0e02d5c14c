"""Conformance examples of ``mean_pooling``: dense, and packed with an empty sequence and
tokens outside every sequence."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def _offsets(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    del values, rng
    return {"cu_seqlens": np.array([3, 13, 13, 40, 41, 66], np.int32)}


def examples() -> list[Example | Invalid]:
    return [
        Example(name="B2-S37-D80-dense", arrays={"x": ((2, 37, 80), FLOAT)}),
        Example(
            name="T70-D48-packed-empty-and-outside",
            arrays={"x": ((70, 48), FLOAT), "cu_seqlens": ((6,), "int32")},
            fill=_offsets,
        ),
        Invalid.extra_axis("x"),
        Invalid.replace("x-integer", x=lambda a: a["x"].astype(np.int32)),
    ]
