"""Conformance examples of ``state_space_v1`` (Mamba-1): gate, step bias and softplus,
initial and final states, numerics (no memory where A = -inf, a NaN, strong decays)."""

from __future__ import annotations

from ejkernel.specs.state_space_v1 import LETTERS
from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._state_space import state_space_examples

__all__ = ["examples"]

SIZES = {"B": 2, "S": 37, "I": 6, "N": 5}


def examples() -> list[Example | Invalid]:
    return state_space_examples(
        SIZES,
        LETTERS,
        tags="gate-dtbias-softplus-state",
        options={"dt_softplus": True, "return_state": True},
        invalid=Invalid.replace("A-wrong-channels", A=lambda a: a["A"][1:]),
    )
