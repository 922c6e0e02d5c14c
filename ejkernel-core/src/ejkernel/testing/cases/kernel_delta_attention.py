"""Conformance examples of ``kernel_delta_attention``: per-channel and per-head decays, with
and without the L2 norm, states, packed sequences."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._linear import PACKED, invalid_linear, linear_example, packed

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    n = len(PACKED) - 1
    return [
        linear_example(
            1,
            70,
            2,
            32,
            16,
            tags="head-decay-packed",
            extra={
                "beta": ((1, 70, 2), FLOAT),
                "g": ((1, 70, 2), FLOAT),
                "cu_seqlens": ((n + 1,), "int32"),
            },
            fill=packed,
        ),
        linear_example(
            2,
            37,
            3,
            16,
            24,
            tags="channel-decay-state",
            extra={
                "beta": ((2, 37, 3), FLOAT),
                "g": ((2, 37, 3, 16), FLOAT),
                "initial_state": ((2, 3, 16, 24), FLOAT),
            },
            options={"return_state": True},
            grad="thorough",  # the XLA backward of per-channel decays compiles for ~20 s
        ),
        linear_example(
            1,
            37,
            2,
            8,
            8,
            tags="no-l2norm",
            extra={"beta": ((1, 37, 2), FLOAT), "g": ((1, 37, 2), FLOAT)},
            options={"use_qk_l2norm": False, "softmax_scale": 0.1},
            thorough=True,
        ),
        *invalid_linear(),
        Invalid.replace("beta-wrong-shape", beta=lambda a: a["beta"][..., None]),
    ]
