"""Conformance examples of ``gla``: odd lengths, initial and final states, packed sequences."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import ODD, invalid_linear, linear_example

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        linear_example(
            *ODD,
            tags="state",
            extra={"g": "[B, S, H, K]", "initial_state": "[N, H, K, V]"},
            options={"return_state": True},
        ),
        linear_example(
            1, 70, 2, 32, 16, tags="packed", extra={"g": "[B, S, H, K]"}, packed_sequences=True
        ),
        *invalid_linear(),
    ]
