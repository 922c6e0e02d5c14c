"""Conformance examples of ``state_space_v2`` (Mamba-2 SSD): grouped B/C, gate, step bias and
softplus, states, a chunk size that does not divide the length."""

from __future__ import annotations

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    b, s, h, p, g, n = 2, 37, 4, 8, 2, 6
    core = {
        "x": ((b, s, h, p), FLOAT),
        "A": ((h,), FLOAT),
        "B": ((b, s, g, n), FLOAT),
        "C": ((b, s, g, n), FLOAT),
        "D": ((h,), FLOAT),
        "dt": ((b, s, h), FLOAT),
    }
    return [
        Example(name=f"B{b}-S{s}-H{h}-P{p}-G{g}-N{n}-plain", arrays=core),
        Example(
            name=f"B{b}-S{s}-H{h}-P{p}-G{g}-N{n}-gate-dtbias-softplus-state-chunk16",
            arrays={
                **core,
                "gate": ((b, s, h, p), FLOAT),
                "dt_bias": ((h,), FLOAT),
                "initial_state": ((b, h, p, n), FLOAT),
            },
            options={"dt_softplus": True, "return_state": True, "chunk_size": 16},
        ),
        Invalid.extra_axis("x"),
        Invalid.replace(
            "B-groups-not-dividing-heads", B=lambda a: a["B"][:, :, :1].repeat(3, axis=2)
        ),
    ]
