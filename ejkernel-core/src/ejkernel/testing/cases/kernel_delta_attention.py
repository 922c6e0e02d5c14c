"""Conformance examples of ``kernel_delta_attention``: per-channel and per-head decays, with
and without the L2 norm, states, packed sequences, numerics (resets, a NaN, strong decays,
empty sequences)."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._linear import invalid_linear, linear_example, packed_example
from ejkernel.testing.cases._numerics import linear_numerics

__all__ = ["examples"]

HEAD_DECAY = {"beta": "[B, S, H]", "g": "[B, S, H]"}


def examples() -> list[Example | Invalid]:
    return [
        packed_example(tags="head-decay-packed", extra=HEAD_DECAY),
        linear_example(
            tags="channel-decay-state",
            extra={"beta": "[B, S, H]", "g": "[B, S, H, K]", "initial_state": "[N, H, K, V]"},
            options={"return_state": True},
            grad="thorough",  # the XLA backward of per-channel decays compiles for ~20 s
        ),
        linear_example(
            b=1,
            h=2,
            k=8,
            v=8,
            tags="no-l2norm",
            extra=HEAD_DECAY,
            options={"use_qk_l2norm": False, "softmax_scale": 0.1},
            thorough=True,
        ),
        *linear_numerics(extra={"beta": "[B, S, H]", "g": "[B, S, H, K]"}, gates=("g",)),
        linear_numerics(extra=HEAD_DECAY, gates=("g",), prefix="head-decay-")[0],
        *invalid_linear(),
        Invalid.replace("beta-wrong-shape", beta=lambda a: a["beta"][..., None]),
    ]
