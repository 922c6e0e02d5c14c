"""The XLA chunked SSD (Mamba-2) against the sequential reference.

Calls go through the public ``ejkernel.state_space_v2`` (the executor wires the custom VJP),
with chunk lengths shorter than the sequences so tails are padded; gradients are ``jax.vjp``
of it against ``jax.vjp`` of the reference. Float32 is held to a relative error of 1e-4 over
300+ steps.
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
from ejkernel.specs.state_space_v2 import state_space_v2_reference
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.state_space_v2 import StateSpaceV2Config, config_space, heuristic

ARRAYS = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")
#: The arrays with a token axis.
PER_TOKEN = ("x", "B", "C", "dt", "gate")


def inputs(
    b: int,
    s: int,
    h: int,
    p: int,
    g: int,
    n: int,
    *,
    dtype: Any = jnp.float32,
    seed: int = 0,
    options: bool = True,
) -> dict[str, Any]:
    """Random inputs (never zeros): A < 0; with ``options`` a gate, dt bias and initial state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    arrays = {
        "x": normal(ks[0], (b, s, h, p), dtype),
        "A": -jnp.exp(0.5 * normal(ks[1], (h,))).astype(dtype),
        "B": normal(ks[2], (b, s, g, n), dtype),
        "C": normal(ks[3], (b, s, g, n), dtype),
        "D": normal(ks[4], (h,), dtype),
        "dt": normal(ks[5], (b, s, h), dtype),
    }
    if options:
        arrays["gate"] = normal(ks[6], (b, s, h, p), dtype)
        arrays["dt_bias"] = (0.5 * normal(ks[7], (h,))).astype(dtype)
        arrays["initial_state"] = normal(ks[8], (b, h, p, n))
    else:
        arrays["dt"] = (0.2 * jax.nn.softplus(arrays["dt"].astype(jnp.float32))).astype(dtype)
    return arrays


#: ``check(arrays, cfg=..., **statics)``: output and gradients of ``ejkernel.state_space_v2``
#: against the reference; returns ours.
check = functools.partial(lc.check_vjp, ejkernel.state_space_v2, state_space_v2_reference, ARRAYS)


@pytest.mark.parametrize(
    ("groups", "chunk"),
    [(1, StateSpaceV2Config(chunk_size=64)), (3, StateSpaceV2Config(chunk_size=16))],
    ids=["H6-G1-C64", "H6-G3-C16"],
)
def test_outputs_states_and_gradients_match_the_reference_over_301_steps(
    groups: int, chunk: Any
) -> None:
    arrays = inputs(2, 301, 6, 8, groups, 5)
    (out, state), _ = check(arrays, cfg=chunk, dt_softplus=True, return_state=True)
    assert out.shape == (2, 301, 6, 8) and state.shape == (2, 6, 8, 5)
    assert state.dtype == jnp.float32


def test_without_gate_bias_softplus_or_state_matches_the_reference() -> None:
    arrays = inputs(1, 97, 4, 8, 4, 6, seed=1, options=False)
    out, _ = check(arrays, cfg=StateSpaceV2Config(chunk_size=16))
    assert out.shape == (1, 97, 4, 8)


def test_the_chunk_size_argument_wins_over_the_config() -> None:
    arrays = inputs(1, 97, 4, 8, 2, 6, seed=2)
    inv = _inv(97, chunk_size=8)
    assert heuristic(inv).chunk_size == 8 and config_space(inv) == [heuristic(inv)]
    record = ejkernel.explain("state_space_v2", **arrays, chunk_size=8)
    assert record.config == StateSpaceV2Config(chunk_size=8)
    # A chunk of 8 with a config asking for 64: same result as the reference.
    check(arrays, cfg=StateSpaceV2Config(chunk_size=64), chunk_size=8, dt_softplus=True)


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = inputs(1, 194, 4, 8, 2, 6, seed=3)
    cfg = StateSpaceV2Config(chunk_size=16)
    lc.check_two_halves(ejkernel.state_space_v2, arrays, PER_TOKEN, 97, dt_softplus=True, cfg=cfg)


def test_decays_that_underflow_inside_a_chunk_stay_finite_and_exact() -> None:
    arrays = inputs(1, 97, 4, 8, 2, 6, seed=4)
    arrays["A"] = jnp.full((4,), -30.0)  # Δ·A down to about -100 per token
    out, grads = check(
        arrays, cfg=StateSpaceV2Config(chunk_size=16), dt_softplus=True, return_state=True
    )
    for x in (*out, *grads.values()):
        assert np.all(np.isfinite(np.asarray(x)))


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = inputs(1, 97, 4, 8, 2, 6, dtype=jnp.bfloat16, seed=5)
    check(
        arrays,
        cfg=StateSpaceV2Config(chunk_size=16),
        scale=1.0,
        dt_softplus=True,
        return_state=True,
    )


def test_jit_of_vmap_of_the_gradient_matches_the_reference() -> None:
    arrays = inputs(1, 40, 2, 4, 1, 3, seed=6)
    cfg = StateSpaceV2Config(chunk_size=16)
    lc.check_jit_vmap_grad(
        functools.partial(ejkernel.state_space_v2, cfg=cfg),
        state_space_v2_reference,
        arrays,
        dt_softplus=True,
    )


def _inv(s: int, chunk_size: int | None = None) -> Any:
    x = jax.ShapeDtypeStruct((1, s, 2, 8), jnp.float32)
    return lc.invocation(x=x, chunk_size=chunk_size)


def test_explain_and_configs() -> None:
    arrays = inputs(1, 37, 2, 4, 1, 3)
    record = ejkernel.explain("state_space_v2", **arrays)
    assert record.platform == "xla" and record.source == "heuristic"
    assert record.config == heuristic(_inv(37))
    assert heuristic(_inv(5)).chunk_size == 8 and heuristic(_inv(4096)).chunk_size >= 32
    space = config_space(_inv(1000))
    assert space[0] == heuristic(_inv(1000)) and len(space) == len(set(space)) > 1
    with pytest.raises(ValueError, match="chunk_size"):
        StateSpaceV2Config(chunk_size=0)


def _bad(**changes: Any) -> dict[str, Any]:
    arrays = inputs(1, 9, 4, 3, 2, 5)
    arrays.update(changes)
    return arrays


test_bad_inputs_raise_clear_errors_before_any_kernel = lc.rejects_bad_inputs(
    ejkernel.state_space_v2,
    {},
    [
        (_bad(x=jnp.ones((1, 9, 4))), ValueError, r"`x` must be \[B, S, H, P\]"),
        (
            _bad(B=jnp.ones((1, 9, 3, 5)), C=jnp.ones((1, 9, 3, 5))),
            ValueError,
            r"`B` must be \[B, S, G, N\] with H % G == 0",
        ),
        (_bad(C=jnp.ones((1, 9, 2, 4))), ValueError, r"`C` must be \[B, S, G, N\]"),
        (_bad(A=jnp.ones((4, 5))), ValueError, r"`A` must be \[H\]"),
        (_bad(D=jnp.ones((3,))), ValueError, r"`D` must be \[H\]"),
        (_bad(dt=jnp.ones((1, 9, 3))), ValueError, r"`dt` must be \[B, S, H\]"),
        (_bad(gate=jnp.ones((1, 9, 4))), ValueError, r"`gate` must be \[B, S, H, P\]"),
        (_bad(dt_bias=jnp.ones((5,))), ValueError, r"`dt_bias` must be \[H\]"),
        (
            _bad(initial_state=jnp.ones((1, 4, 5, 3))),
            ValueError,
            r"`initial_state` must be \[B, H, P, N\]",
        ),
        (_bad(x=jnp.ones((1, 9, 4, 3), jnp.int32)), TypeError, r"`x` must be a floating array"),
    ],
    ids=["x", "B-groups", "C", "A", "D", "dt", "gate", "dt_bias", "initial_state", "int-x"],
)


def test_bad_statics_raise_errors() -> None:
    with pytest.raises(ValueError, match=r"^state_space_v2: `chunk_size` must be a positive int"):
        ejkernel.state_space_v2(**_bad(), chunk_size=0)
    with pytest.raises(TypeError, match=r"^state_space_v2: `dt_softplus` must be a bool"):
        ejkernel.state_space_v2(**_bad(), dt_softplus="yes")


def test_synthetic_autotuning_inputs_decay_and_stay_finite() -> None:
    from ejkernel.specs.state_space_v2 import SPEC

    made = lc.synthetic_like(SPEC, _bad())
    assert np.all(np.asarray(made["A"]) < 0.0) and np.all(np.asarray(made["dt"]) > 0.0)
    out = state_space_v2_reference(**made)
    assert np.all(np.isfinite(np.asarray(out)))
