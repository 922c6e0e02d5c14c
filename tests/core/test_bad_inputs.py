"""Inputs a user gets wrong raise a TypeError/ValueError naming the argument, before any
kernel runs; through each op's public function on the XLA platform."""

from __future__ import annotations

import math
from typing import Any

import pytest

import ejkernel
from ejkernel.specs import builtin_ops, builtin_spec
from ejkernel.testing._examples import examples_of

pytestmark = pytest.mark.filterwarnings("ignore")


def first_example(op: str) -> dict[str, Any]:
    """The arguments of the op's first conformance example (float32)."""
    spec = builtin_spec(op)
    return examples_of(spec)[0].build(spec, "float32")


def call(op: str, args: dict[str, Any]) -> Any:
    return getattr(ejkernel, op)(**args, platform="xla")


SCALED = [op for op in builtin_ops() if "softmax_scale" in builtin_spec(op).arg_names]


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("op", SCALED)
def test_softmax_scale_must_be_finite(op: str, scale: float) -> None:
    with pytest.raises(ValueError, match=rf"{op}: `softmax_scale` must be a finite number"):
        call(op, {**first_example(op), "softmax_scale": scale})
