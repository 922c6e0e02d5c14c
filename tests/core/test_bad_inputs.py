"""Inputs a user gets wrong raise a TypeError/ValueError naming the argument, before any
kernel runs; through each op's public function on the XLA platform."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
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


DROPOUT = [op for op in builtin_ops() if "dropout_seed" in builtin_spec(op).arg_names]


@pytest.mark.parametrize("seed", [2**31, 2**40, -(2**31) - 1])
@pytest.mark.parametrize("op", DROPOUT)
def test_dropout_seed_must_fit_int32(op: str, seed: int) -> None:
    args = {**first_example(op), "dropout_prob": 0.1, "dropout_seed": seed}
    with pytest.raises(ValueError, match=rf"{op}: `dropout_seed` must be in \[-2\*\*31, 2\*\*31\)"):
        call(op, args)


@pytest.mark.parametrize("op", DROPOUT)
def test_traced_dropout_prob_is_a_type_error(op: str) -> None:
    args = first_example(op)
    with pytest.raises(TypeError, match=rf"{op}: `dropout_prob` must be a Python float"):
        jax.jit(lambda p: call(op, {**args, "dropout_prob": p}))(0.1)


BAD_CU_SEQLENS = [
    ("float", lambda s: jnp.asarray([0.0, s]), TypeError, "`cu_seqlens` must be an integer"),
    ("one-offset", lambda s: jnp.asarray([0]), ValueError, r"`cu_seqlens` must be \[N \+ 1\]"),
    ("2d", lambda s: jnp.asarray([[0, s]]), ValueError, r"`cu_seqlens` must be \[N \+ 1\]"),
    ("past-S", lambda s: jnp.asarray([0, s + 1]), ValueError, "must lie in"),
    ("negative", lambda s: jnp.asarray([-1, s]), ValueError, "must lie in"),
    ("decreasing", lambda s: jnp.asarray([0, 5, 3, s]), ValueError, "never decrease"),
]


def packed_example(op: str) -> dict[str, Any]:
    """A valid packed call of the op (B == 1, cu_seqlens given)."""
    spec = builtin_spec(op)
    for example in examples_of(spec):
        if "cu_seqlens" in example.arrays:
            return example.build(spec, "float32")
    raise AssertionError(f"{op} has no packed example")


@pytest.mark.parametrize(
    "name,make,error,match", BAD_CU_SEQLENS, ids=[c[0] for c in BAD_CU_SEQLENS]
)
@pytest.mark.parametrize("op", ["native_sparse_attention", "kernel_delta_attention"])
def test_cu_seqlens_checked_alike(op: str, name: str, make: Any, error: type, match: str) -> None:
    args = packed_example(op)
    s = args["query"].shape[1]
    with pytest.raises(error, match=rf"{op}: .*{match}"):
        call(op, {**args, "cu_seqlens": make(s)})
