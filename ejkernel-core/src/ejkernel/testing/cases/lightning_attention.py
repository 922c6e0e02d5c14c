"""Conformance examples of ``lightning_attention``: given slopes with states, MiniMax-01
slopes from the layer index, packed sequences."""

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
            4,
            16,
            24,
            tags="slopes-state",
            extra={"slopes": ((4,), FLOAT), "initial_state": ((2, 4, 16, 24), FLOAT)},
            options={"return_state": True},
        ),
        linear_example(
            1,
            70,
            3,
            32,
            16,
            tags="layer-slopes-packed",
            extra={"cu_seqlens": ((n + 1,), "int32")},
            options={"layer_idx": 2, "num_layers": 8},
            fill=packed,
        ),
        *invalid_linear(),
    ]
