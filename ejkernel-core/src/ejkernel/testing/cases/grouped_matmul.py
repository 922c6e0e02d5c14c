"""Conformance examples of ``grouped_matmul``: empty groups, rows past the groups, transposed
right-hand sides, a wider output dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of, sizes_id

__all__ = ["examples"]


def _example(
    m: int, k: int, n: int, group_sizes: tuple[int, ...], *, tags: str, **kw: Any
) -> Example:
    """``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` when transposed) and the given
    ``group_sizes``."""
    sizes = {"M": m, "K": k, "N": n, "G": len(group_sizes)}
    rhs = "[G, N, K]" if kw.get("options", {}).get("transpose_rhs") else "[G, K, N]"

    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del values, rng
        return {"group_sizes": np.asarray(group_sizes, np.int32)}

    return Example(
        name=f"{sizes_id(sizes)}-{tags}",
        arrays={
            **arrays_of(sizes, lhs="[M, K]", rhs=rhs),
            **arrays_of(sizes, "int32", group_sizes="[G]"),
        },
        fill=fill,
        **kw,
    )


def examples() -> list[Example | Invalid]:
    return [
        _example(37, 80, 48, (7, 0, 13, 9, 5), tags="empty-group-rows-past"),
        _example(
            129,
            64,
            40,
            (60, 40, 29),
            tags="transposed-f32-out",
            options={"transpose_rhs": True, "preferred_element_type": "float32"},
        ),
        Invalid.extra_axis("lhs"),
        Invalid.replace("rhs-depth-differs", rhs=lambda a: a["rhs"][:, 1:]),
    ]
