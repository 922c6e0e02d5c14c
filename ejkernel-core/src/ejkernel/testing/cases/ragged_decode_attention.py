"""Conformance examples of ``ragged_decode_attention``: empty and one-token ranges, ranges
that do not start at 0, GQA/MQA, sinks, soft cap and sliding window."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def _ranges(start: tuple[int, ...], end: tuple[int, ...]) -> Any:
    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del values, rng
        return {
            "sequence_start": np.asarray(start, np.int32),
            "sequence_end": np.asarray(end, np.int32),
        }

    return fill


def examples() -> list[Example | Invalid]:
    b, sk = 4, 129
    return [
        Example(
            name=f"B{b}-Sk{sk}-Hq8-Hkv2-D80-ranges",
            arrays={
                "query": ((b, 8, 80), FLOAT),
                "key": ((b, sk, 2, 80), FLOAT),
                "value": ((b, sk, 2, 80), FLOAT),
                "sequence_start": ((b,), "int32"),
                "sequence_end": ((b,), "int32"),
            },
            fill=_ranges((0, 5, 20, 128), (37, 5, 129, 129)),
        ),
        Example(
            name="B3-Sk37-Hq4-Hkv1-D64-Dv48-sinks-softcap-window",
            arrays={
                "query": ((3, 4, 64), FLOAT),
                "key": ((3, 37, 1, 64), FLOAT),
                "value": ((3, 37, 1, 48), FLOAT),
                "sequence_start": ((3,), "int32"),
                "sequence_end": ((3,), "int32"),
                "softmax_aux": ((4,), FLOAT),
            },
            options={"logits_soft_cap": 10.0, "sliding_window": (11, 0)},
            fill=_ranges((0, 3, 30), (37, 30, 31)),
        ),
        Invalid.extra_axis("query"),
        Invalid.replace("sequence_end-wrong-length", sequence_end=lambda a: a["sequence_end"][1:]),
    ]
