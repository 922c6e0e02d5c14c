"""Conformance examples of ``gla``: odd lengths, initial and final states, packed sequences."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._linear import PACKED, invalid_linear, linear_example, packed

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    n = len(PACKED) - 1
    return [
        linear_example(
            2,
            37,
            3,
            16,
            24,
            tags="state",
            extra={"g": ((2, 37, 3, 16), FLOAT), "initial_state": ((2, 3, 16, 24), FLOAT)},
            options={"return_state": True},
        ),
        linear_example(
            1,
            70,
            2,
            32,
            16,
            tags="packed",
            extra={"g": ((1, 70, 2, 32), FLOAT), "cu_seqlens": ((n + 1,), "int32")},
            fill=packed,
        ),
        *invalid_linear(),
    ]
