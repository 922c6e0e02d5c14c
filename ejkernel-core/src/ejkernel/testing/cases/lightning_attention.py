"""Conformance examples of ``lightning_attention``: given slopes with states, MiniMax-01
slopes from the layer index, packed sequences, numerics (an infinite slope forgets at every
token, a NaN, strong decays, empty sequences)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import invalid_linear, linear_example, packed_example
from ejkernel.testing.cases._numerics import linear_numerics

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
        *linear_numerics(
            extra={"slopes": "[H]"},
            gates=(),
            reset=_infinite_slope,
            strong=lambda values, rng: {"slopes": np.full_like(values["slopes"], 20.0)},
        ),
        *invalid_linear(),
    ]


def _infinite_slope(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Head 1 forgets its state at every token (its log gate is -inf)."""
    del rng
    slopes = np.array(values["slopes"], np.float32)
    slopes[1] = np.inf
    return {"slopes": slopes}
