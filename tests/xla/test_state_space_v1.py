"""The XLA chunked selective scan (Mamba-1) against the sequential reference.

Calls go through the public ``ejkernel.state_space_v1`` (the executor wires the custom VJP),
with chunk lengths shorter than the sequences so tails are padded, for both intra-chunk
solvers; gradients are ``jax.vjp`` of it against ``jax.vjp`` of the reference. Float32 is held
to a relative error of 1e-4 over 300+ steps.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _linear_cases as lc

import ejkernel
from ejkernel.specs.state_space_v1 import state_space_v1_reference
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.state_space_v1 import StateSpaceV1Config, config_space, heuristic

#: The arrays with a token axis.
PER_TOKEN = ("x", "B", "C", "dt", "gate")
ARRAYS = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")
PARALLEL = StateSpaceV1Config(chunk_size=16, intra_chunk="associative")
LOOP = StateSpaceV1Config(chunk_size=16, intra_chunk="sequential")


def inputs(
    b: int, s: int, i: int, n: int, *, dtype: Any = jnp.float32, seed: int = 0, options: bool = True
) -> dict[str, Any]:
    """Random inputs (never zeros): A < 0; with ``options`` a gate, dt bias and initial state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    arrays = {
        "x": normal(ks[0], (b, s, i), dtype),
        "A": -jnp.exp(0.5 * normal(ks[1], (i, n))).astype(dtype),
        "B": normal(ks[2], (b, s, n), dtype),
        "C": normal(ks[3], (b, s, n), dtype),
        "D": normal(ks[4], (i,), dtype),
        "dt": normal(ks[5], (b, s, i), dtype),
    }
    if options:
        arrays["gate"] = normal(ks[6], (b, s, i), dtype)
        arrays["dt_bias"] = (0.5 * normal(ks[7], (i,))).astype(dtype)
        arrays["initial_state"] = normal(ks[8], (b, i, n))
    else:
        arrays["dt"] = (0.2 * jax.nn.softplus(arrays["dt"].astype(jnp.float32))).astype(dtype)
    return arrays


#: ``check(arrays, cfg=..., **statics)``: output and gradients of ``ejkernel.state_space_v1``
#: against the reference; returns ours.
check = functools.partial(lc.check_vjp, ejkernel.state_space_v1, state_space_v1_reference, ARRAYS)


@pytest.mark.parametrize("cfg", [PARALLEL, LOOP], ids=["associative-C16", "sequential-C16"])
def test_outputs_states_and_gradients_match_the_reference_over_301_steps(cfg: Any) -> None:
    arrays = inputs(2, 301, 12, 5)
    (out, state), _ = check(arrays, cfg=cfg, dt_softplus=True, return_state=True)
    assert out.shape == (2, 301, 12) and state.shape == (2, 12, 5)
    assert state.dtype == jnp.float32


def test_without_gate_bias_softplus_or_state_matches_the_reference() -> None:
    arrays = inputs(1, 97, 8, 4, seed=1, options=False)
    out, _ = check(arrays, cfg=StateSpaceV1Config(chunk_size=32, intra_chunk="associative"))
    assert out.shape == (1, 97, 8)


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = inputs(1, 194, 8, 4, seed=2)
    lc.check_two_halves(
        ejkernel.state_space_v1, arrays, PER_TOKEN, 97, dt_softplus=True, cfg=PARALLEL
    )


def test_decays_that_underflow_stay_finite_and_exact() -> None:
    arrays = inputs(1, 97, 8, 4, seed=3)
    arrays["A"] = arrays["A"] * 40.0  # Δ·A down to about -100 per token
    out, grads = check(arrays, cfg=PARALLEL, dt_softplus=True, return_state=True)
    for x in (*out, *grads.values()):
        assert np.all(np.isfinite(np.asarray(x)))


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = inputs(1, 97, 8, 4, dtype=jnp.bfloat16, seed=4)
    check(arrays, cfg=PARALLEL, scale=1.0, dt_softplus=True, return_state=True)


def test_jit_of_vmap_of_the_gradient_matches_the_reference() -> None:
    arrays = inputs(1, 40, 4, 3, seed=5)
    lc.check_jit_vmap_grad(
        functools.partial(ejkernel.state_space_v1, cfg=LOOP),
        state_space_v1_reference,
        arrays,
        dt_softplus=True,
    )


def _inv(s: int) -> Any:
    return lc.invocation(x=jax.ShapeDtypeStruct((1, s, 8), jnp.float32))


def test_explain_and_configs() -> None:
    arrays = inputs(1, 37, 4, 3)
    record = ejkernel.explain("state_space_v1", **arrays)
    assert record.platform == "xla" and record.source == "heuristic"
    assert record.config == heuristic(_inv(37))
    assert record.config.intra_chunk == "sequential"  # the CPU default
    assert heuristic(_inv(5)).chunk_size == 8
    space = config_space(_inv(1000))
    assert space[0] == heuristic(_inv(1000)) and len(space) == len(set(space)) > 1
    assert {c.intra_chunk for c in space} == {"sequential", "associative"}
    with pytest.raises(ValueError, match="intra_chunk"):
        StateSpaceV1Config(intra_chunk="magic")
    with pytest.raises(ValueError, match="chunk_size"):
        StateSpaceV1Config(chunk_size=-1)


def _bad(**changes: Any) -> dict[str, Any]:
    arrays = inputs(1, 9, 4, 5)
    arrays.update(changes)
    return arrays


test_bad_inputs_raise_clear_errors_before_any_kernel = lc.rejects_bad_inputs(
    ejkernel.state_space_v1,
    {},
    [
        (_bad(x=jnp.ones((1, 9, 4, 1))), ValueError, r"`x` must be \[B, S, I\]"),
        (_bad(A=jnp.ones((3, 5))), ValueError, r"`A` must be \[I, N\]"),
        (_bad(B=jnp.ones((1, 9, 4))), ValueError, r"`B` must be \[B, S, N\]"),
        (_bad(C=jnp.ones((1, 8, 5))), ValueError, r"`C` must be \[B, S, N\]"),
        (_bad(D=jnp.ones((5,))), ValueError, r"`D` must be \[I\]"),
        (_bad(dt=jnp.ones((1, 9, 5))), ValueError, r"`dt` must be \[B, S, I\]"),
        (_bad(gate=jnp.ones((1, 9, 5))), ValueError, r"`gate` must be \[B, S, I\]"),
        (_bad(dt_bias=jnp.ones((1, 4))), ValueError, r"`dt_bias` must be \[I\]"),
        (
            _bad(initial_state=jnp.ones((1, 5, 4))),
            ValueError,
            r"`initial_state` must be \[B, I, N\]",
        ),
        (_bad(B=jnp.ones((1, 9, 5), jnp.int32)), TypeError, r"`B` must be a floating array"),
    ],
    ids=["x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state", "int-B"],
)


def test_bad_flags_raise_type_errors() -> None:
    with pytest.raises(TypeError, match=r"^state_space_v1: `return_state` must be a bool"):
        ejkernel.state_space_v1(**_bad(), return_state=1)


def test_synthetic_autotuning_inputs_decay_and_stay_finite() -> None:
    from ejkernel.specs.state_space_v1 import SPEC

    made = lc.synthetic_like(SPEC, _bad())
    assert np.all(np.asarray(made["A"]) < 0.0) and np.all(np.asarray(made["dt"]) > 0.0)
    out = state_space_v1_reference(**made)
    assert np.all(np.isfinite(np.asarray(out)))
