"""Conformance examples of ``state_space_v1`` (Mamba-1): gate, step bias and softplus,
initial and final states."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of, sizes_id

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    sizes = {"B": 2, "S": 37, "I": 24, "N": 12}
    core = arrays_of(
        sizes, x="[B, S, I]", A="[I, N]", B="[B, S, N]", C="[B, S, N]", D="[I]", dt="[B, S, I]"
    )
    extra = arrays_of(sizes, gate="[B, S, I]", dt_bias="[I]", initial_state="[B, I, N]")
    return [
        Example(name=f"{sizes_id(sizes)}-plain", arrays=core),
        Example(
            name=f"{sizes_id(sizes)}-gate-dtbias-softplus-state",
            arrays={**core, **extra},
            options={"dt_softplus": True, "return_state": True},
        ),
        Invalid.extra_axis("x"),
        Invalid.replace("A-wrong-channels", A=lambda a: a["A"][1:]),
    ]
