"""Conformance examples of ``gla``: odd lengths, initial and final states, packed sequences,
numerics (resets, a NaN, strong decays, empty sequences)."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import invalid_linear, linear_example, packed_example
from ejkernel.testing.cases._numerics import linear_numerics

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        linear_example(
            tags="state",
            extra={"g": "[B, S, H, K]", "initial_state": "[N, H, K, V]"},
            options={"return_state": True},
        ),
        packed_example(tags="packed", extra={"g": "[B, S, H, K]"}),
        *linear_numerics(extra={"g": "[B, S, H, K]"}, gates=("g",)),
        *invalid_linear(),
    ]
