"""The XLA recurrent (chunked) against the sequential reference: gates, directions, states,
packed sequences, both intra-chunk forms, dtypes, transformations, configs and errors.

Every call goes through the public ``ejkernel.recurrent`` (the executor wires the custom VJP)
with small chunks so that sequences span several chunks and end in a padded one. Float32 is
held to 1e-4 relative error (the issue's bound for chunked linear attention: sums regroup by
chunk), bfloat16 to 1e-2.
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
from ejkernel.specs.recurrent import recurrent_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops import _chunked as engine
from ejkernel_xla.ops import recurrent
from ejkernel_xla.ops.recurrent import RecurrentConfig, config_space, heuristic

#: Chunks of 16 tokens in sub-chunks of 4: a 37-token sequence is 3 chunks, the last padded.
SMALL = RecurrentConfig(chunk_size=16, sub_chunk_size=4)
GATES = ("g", "gk", "gv")
DIFFERENTIABLE = ("query", "key", "value", "g", "gk", "gv", "initial_state")


def make_inputs(
    *sizes: int,
    gates: tuple[str, ...] = (),
    strength: float = 0.25,
    num_states: int | None = None,
    dtype: Any = jnp.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """q, k, v of ``sizes`` (B, S, H, Dk, Dv) in ``dtype``, float32 log-sigmoid gates scaled by ``strength``, and an initial
    state for ``num_states`` sequences when given."""
    b, s, h, dk, dv = sizes
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    arrays = lc.qkv(keys, sizes, dtype)
    shapes = {"g": (b, s, h), "gk": (b, s, h, dk), "gv": (b, s, h, dv)}
    for i, name in enumerate(gates):
        arrays[name] = jax.nn.log_sigmoid(normal(keys[3 + i], shapes[name]) + 1.0) * strength
    if num_states is not None:
        arrays["initial_state"] = normal(keys[7], (num_states, h, dk, dv))
    return arrays


#: ``check(arrays, **statics)``: output and gradients of ``ejkernel.recurrent`` against the reference
#: (in ``SMALL`` chunks unless ``cfg`` is given); returns ours.
check = functools.partial(
    lc.check_vjp, ejkernel.recurrent, recurrent_reference, DIFFERENTIABLE, cfg=SMALL
)


CASES = [
    pytest.param(("g", "gk", "gv"), True, True, False, id="g-gk-gv-initial-state-return-state"),
    pytest.param(("g",), False, True, True, id="g-reverse-return-state"),
    pytest.param(("gk", "gv"), True, False, True, id="gk-gv-initial-state-reverse"),
    pytest.param((), False, False, False, id="no-gates"),
]


@pytest.mark.parametrize(("gates", "with_state", "return_state", "reverse"), CASES)
def test_gates_states_and_directions_match_the_reference(
    gates: tuple[str, ...], with_state: bool, return_state: bool, reverse: bool
) -> None:
    # B2-S37-H3-K16-V24: mild gates take the factored intra-chunk form, strong ones (a chunk's
    # decay far beyond exp(-80)) the exact two-level form; both against the same oracle.
    for strength in (0.25, 12.0):
        arrays = make_inputs(
            2, 37, 3, 16, 24, gates=gates, strength=strength, num_states=2 if with_state else None
        )
        check(arrays, return_state=return_state, reverse=reverse, softmax_scale=0.3)


def test_strong_gates_take_the_exact_form_and_mild_ones_the_factored_form() -> None:
    st = engine.LinearStatics(scale=1.0, reverse=False, return_state=False, chunk=16, sub_chunk=4)
    for strength, factored in ((0.25, True), (12.0, False)):
        arrays = make_inputs(2, 37, 3, 16, 24, gates=GATES, strength=strength)
        arrays.update(cu_seqlens=None, initial_state=None)
        assert bool(engine.factorable_call(arrays, st, recurrent._recurrent_gates)) is factored
    only_g = make_inputs(2, 37, 3, 16, 24, gates=("g",), strength=12.0)
    only_g.update(gk=None, gv=None, cu_seqlens=None)
    assert engine.factorable_call(only_g, st, recurrent._recurrent_gates) is None  # scalar: exact


def test_three_hundred_steps_stay_within_1e_4_in_float32() -> None:
    # One chunk size of the defaults (64): 333 tokens are 6 chunks, the last one padded.
    arrays = make_inputs(1, 333, 2, 32, 32, gates=("g", "gk"), num_states=1)
    out, final = ejkernel.recurrent(**arrays, return_state=True)
    ref_out, ref_final = recurrent_reference(**arrays, return_state=True)
    assert_close(out, ref_out, scale=lc.F32, name="out")
    assert_close(final, ref_final, scale=lc.F32, name="final_state")


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_packed_sequences_reset_states_with_empty_and_single_token_sequences(reverse: bool) -> None:
    # Sequences of 1, 0, 17 and 15 tokens in 37, starting at token 2: tokens 0-1 and 35-36
    # belong to no sequence. Each sequence has its own initial and final state; the chunk
    # layout puts each on fresh chunks (16 tokens), the 17-token one over two.
    cu = jnp.asarray([2, 3, 3, 20, 35], jnp.int32)
    arrays = make_inputs(1, 37, 3, 16, 24, gates=GATES, num_states=4)
    arrays["cu_seqlens"] = cu
    if reverse:  # the layout's flips are differentiated by JAX; the forward pins them down
        out, final = ejkernel.recurrent(**arrays, return_state=True, reverse=True, cfg=SMALL)
        ref_out, ref_final = recurrent_reference(**arrays, return_state=True, reverse=True)
        assert_close((out, final), (ref_out, ref_final), scale=lc.F32)
    else:
        (out, final), _ = check(arrays, return_state=True)
    assert np.all(np.asarray(out)[0, :2] == 0.0) and np.all(np.asarray(out)[0, 35:] == 0.0)
    np.testing.assert_array_equal(final[1], arrays["initial_state"][1])  # the empty sequence


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = make_inputs(2, 37, 3, 16, 24, gates=("g",), num_states=2, dtype=jnp.bfloat16)
    check(arrays, return_state=True, scale=1.0)


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = make_inputs(2, 40, 3, 16, 24, gates=("g",), num_states=2)
    lc.check_two_halves(ejkernel.recurrent, arrays, ("query", "key", "value", "g"), 20, cfg=SMALL)


def test_jit_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(2, 37, 3, 16, 24, gates=("g", "gv"))
    ours = functools.partial(ejkernel.recurrent, cfg=SMALL)
    lc.check_jit_vmap_grad(ours, recurrent_reference, arrays)


def test_explain_reports_the_xla_heuristic_config() -> None:
    arrays = make_inputs(2, 37, 3, 16, 24, gates=("gk",))
    record = ejkernel.explain("recurrent", **arrays)
    assert record.platform == "xla"
    assert record.source == "heuristic"
    assert record.config == RecurrentConfig(chunk_size=64, sub_chunk_size=16)


@pytest.mark.parametrize(
    ("s", "cu", "chunk"),
    [(4096, None, 64), (37, None, 64), (5, None, 8), (4096, 256, 16), (4096, 16, 64)],
    ids=["S4096", "S37", "S5", "S4096-256-packed", "S4096-16-packed"],
)
def test_heuristic_chunks_shrink_for_short_and_short_packed_sequences(
    s: int, cu: int | None, chunk: int
) -> None:
    inv = lc.linear_invocation(s, cu)
    cfg = heuristic(inv)
    assert cfg.chunk_size == chunk and cfg.chunk_size % cfg.sub_chunk_size == 0
    space = config_space(inv)
    assert space[0] == cfg and len(space) == len(set(space)) <= 8
    assert all(c.chunk_size % c.sub_chunk_size == 0 for c in space)


def test_a_config_whose_sub_chunk_does_not_divide_the_chunk_is_refused() -> None:
    arrays = make_inputs(1, 37, 2, 8, 8, gates=("gk",))
    with pytest.raises(ValueError, match="sub_chunk_size must divide chunk_size"):
        ejkernel.recurrent(**arrays, cfg=RecurrentConfig(chunk_size=32, sub_chunk_size=12))


#: A valid call; the bad-input cases change some of its arguments.
VALID = make_inputs(2, 37, 3, 16, 24, gates=("g",))


test_bad_inputs_raise_clear_errors_before_any_kernel = lc.rejects_bad_linear_inputs(
    ejkernel.recurrent,
    VALID,
    [
        pytest.param(
            {"g": jnp.zeros((2, 37, 3, 1))}, ValueError, r"`g` must be \[B, S, H\]", id="g-shape"
        ),
        pytest.param(
            {"gk": jnp.zeros((2, 37, 3, 24))},
            ValueError,
            r"`gk` must be \[B, S, H, K\]",
            id="gk-shape",
        ),
        pytest.param(
            {"gv": jnp.zeros((2, 37, 3, 24), jnp.int32)},
            TypeError,
            "`gv` must be a floating",
            id="gv-int",
        ),
        pytest.param({"reverse": 1}, TypeError, "`reverse` must be a bool", id="reverse-int"),
    ],
)


def test_packed_initial_state_needs_one_row_per_sequence() -> None:
    arrays = make_inputs(1, 37, 3, 16, 24, num_states=2)
    with pytest.raises(
        ValueError, match=r"^recurrent: `initial_state` must be floating \[N, H, K, V\]"
    ):
        ejkernel.recurrent(**arrays, cu_seqlens=jnp.asarray([0, 10, 20, 37]))
