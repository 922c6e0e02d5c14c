"""Conformance examples of ``gla``: odd lengths, initial and final states, packed sequences."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import invalid_linear, linear_example

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        linear_example(
            tags="state",
            extra={"g": "[B, S, H, K]", "initial_state": "[N, H, K, V]"},
            options={"return_state": True},
        ),
        linear_example(
            h=2, k=32, v=16, tags="packed", extra={"g": "[B, S, H, K]"}, packed_sequences=True
        ),
        *invalid_linear(),
    ]
