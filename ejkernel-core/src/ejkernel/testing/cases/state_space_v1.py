"""Conformance examples of ``state_space_v1`` (Mamba-1): gate, step bias and softplus,
initial and final states, numerics (no memory where A = -inf, a NaN, strong decays)."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._state_space import state_space_examples

__all__ = ["examples"]

SIZES = {"B": 2, "S": 37, "I": 6, "N": 5}
CORE = {
    "x": "[B, S, I]",
    "A": "[I, N]",
    "B": "[B, S, N]",
    "C": "[B, S, N]",
    "D": "[I]",
    "dt": "[B, S, I]",
}


def examples() -> list[Example | Invalid]:
    return state_space_examples(
        SIZES,
        core=CORE,
        extra={"gate": "[B, S, I]", "dt_bias": "[I]", "initial_state": "[B, I, N]"},
        tags="gate-dtbias-softplus-state",
        options={"dt_softplus": True, "return_state": True},
        invalid=Invalid.replace("A-wrong-channels", A=lambda a: a["A"][1:]),
    )
