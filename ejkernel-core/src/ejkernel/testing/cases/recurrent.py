"""Conformance examples of ``recurrent``: every gate, initial and final states, reverse,
packed sequences, numerics run in reverse (resets, a NaN, strong decays, empty sequences)."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import invalid_linear, linear_example, packed_example
from ejkernel.testing.cases._numerics import linear_numerics

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        linear_example(
            tags="g-gk-state",
            extra={"g": "[B, S, H]", "gk": "[B, S, H, K]", "initial_state": "[N, H, K, V]"},
            options={"return_state": True},
        ),
        packed_example(
            tags="gv-reverse-packed-state",
            extra={"gv": "[B, S, H, V]", "initial_state": "[N, H, K, V]"},
            options={"reverse": True, "return_state": True, "softmax_scale": 0.3},
        ),
        *linear_numerics(
            extra={"g": "[B, S, H]", "gk": "[B, S, H, K]", "gv": "[B, S, H, V]"},
            gates=("g", "gk", "gv"),
            prefix="reverse-",
            options={"reverse": True},
        ),
        *invalid_linear(),
    ]
