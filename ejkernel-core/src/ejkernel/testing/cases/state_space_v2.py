"""Conformance examples of ``state_space_v2`` (Mamba-2 SSD): grouped B/C, gate, step bias and
softplus, states, a chunk size that does not divide the length."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of, sizes_id

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    sizes = {"B": 2, "S": 37, "H": 4, "P": 8, "G": 2, "N": 6}
    core = arrays_of(
        sizes,
        x="[B, S, H, P]",
        A="[H]",
        B="[B, S, G, N]",
        C="[B, S, G, N]",
        D="[H]",
        dt="[B, S, H]",
    )
    extra = arrays_of(sizes, gate="[B, S, H, P]", dt_bias="[H]", initial_state="[B, H, P, N]")
    return [
        Example(name=f"{sizes_id(sizes)}-plain", arrays=core),
        Example(
            name=f"{sizes_id(sizes)}-gate-dtbias-softplus-state-chunk16",
            arrays={**core, **extra},
            options={"dt_softplus": True, "return_state": True, "chunk_size": 16},
        ),
        Invalid.extra_axis("x"),
        Invalid.replace(
            "B-groups-not-dividing-heads", B=lambda a: a["B"][:, :, :1].repeat(3, axis=2)
        ),
    ]
