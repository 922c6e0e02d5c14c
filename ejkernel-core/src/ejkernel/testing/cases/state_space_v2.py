"""Conformance examples of ``state_space_v2`` (Mamba-2 SSD): grouped B/C, gate, step bias and
softplus, states, a chunk size that does not divide the length, numerics (no memory where A = -inf, a NaN, strong decays)."""

from __future__ import annotations

from ejkernel.specs.state_space_v2 import LETTERS
from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._state_space import state_space_examples

__all__ = ["examples"]

SIZES = {"B": 2, "S": 37, "H": 4, "P": 8, "G": 2, "N": 6}


def examples() -> list[Example | Invalid]:
    return state_space_examples(
        SIZES,
        LETTERS,
        tags="gate-dtbias-softplus-state-chunk16",
        options={"dt_softplus": True, "return_state": True, "chunk_size": 16},
        invalid=Invalid.replace(
            "B-groups-not-dividing-heads", B=lambda a: a["B"][:, :, :1].repeat(3, axis=2)
        ),
    )
