"""Conformance examples of ``lightning_attention``: given slopes with states, MiniMax-01
slopes from the layer index, packed sequences."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import invalid_linear, linear_example, packed_example

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [
        linear_example(
            h=4,
            tags="slopes-state",
            extra={"slopes": "[H]", "initial_state": "[N, H, K, V]"},
            options={"return_state": True},
        ),
        packed_example(
            h=3, tags="layer-slopes-packed", extra={}, options={"layer_idx": 2, "num_layers": 8}
        ),
        *invalid_linear(),
    ]
