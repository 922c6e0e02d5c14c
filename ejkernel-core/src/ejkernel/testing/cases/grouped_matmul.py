"""Conformance examples of ``grouped_matmul``: empty groups, rows past the groups, transposed
right-hand sides, a wider output dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def _sizes(*sizes: int) -> Any:
    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del values, rng
        return {"group_sizes": np.asarray(sizes, np.int32)}

    return fill


def examples() -> list[Example | Invalid]:
    return [
        Example(
            name="M37-K80-N48-G5-empty-group-rows-past",
            arrays={
                "lhs": ((37, 80), FLOAT),
                "rhs": ((5, 80, 48), FLOAT),
                "group_sizes": ((5,), "int32"),
            },
            fill=_sizes(7, 0, 13, 9, 5),
        ),
        Example(
            name="M129-K64-N40-G3-transposed-f32-out",
            arrays={
                "lhs": ((129, 64), FLOAT),
                "rhs": ((3, 40, 64), FLOAT),
                "group_sizes": ((3,), "int32"),
            },
            options={"transpose_rhs": True, "preferred_element_type": "float32"},
            fill=_sizes(60, 40, 29),
        ),
        Invalid.extra_axis("lhs"),
        Invalid.replace("rhs-depth-differs", rhs=lambda a: a["rhs"][:, 1:]),
    ]
