"""Conformance examples of ``state_space_v1`` (Mamba-1): gate, step bias and softplus,
initial and final states."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    b, s, i, n = 2, 37, 24, 12
    core = {
        "x": ((b, s, i), FLOAT),
        "A": ((i, n), FLOAT),
        "B": ((b, s, n), FLOAT),
        "C": ((b, s, n), FLOAT),
        "D": ((i,), FLOAT),
        "dt": ((b, s, i), FLOAT),
    }
    return [
        Example(name=f"B{b}-S{s}-I{i}-N{n}-plain", arrays=core),
        Example(
            name=f"B{b}-S{s}-I{i}-N{n}-gate-dtbias-softplus-state",
            arrays={
                **core,
                "gate": ((b, s, i), FLOAT),
                "dt_bias": ((i,), FLOAT),
                "initial_state": ((b, i, n), FLOAT),
            },
            options={"dt_softplus": True, "return_state": True},
        ),
        Invalid.extra_axis("x"),
        Invalid.replace("A-wrong-channels", A=lambda a: a["A"][1:]),
    ]
