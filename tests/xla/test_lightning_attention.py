"""The XLA lightning_attention (chunked) against the sequential reference: MiniMax-01 slopes,
outputs and gradients (q, k, v, slopes, initial_state), packed sequences, long sequences,
bfloat16, state round trips, transformations, configs and errors.

Calls go through the public ``ejkernel.lightning_attention`` (the executor wires the custom
VJP). Float32 is held to 1e-4 relative error (the issue's bound for chunked linear attention),
bfloat16 to 1e-2.
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
from ejkernel.specs.lightning_attention import lightning_attention_reference, lightning_slopes
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.lightning_attention import (
    LightningAttentionConfig,
    config_space,
    heuristic,
)

#: 16-token chunks: a 37-token sequence is 3 chunks, the last padded.
SMALL = LightningAttentionConfig(chunk_size=16)
DIFFERENTIABLE = ("query", "key", "value", "slopes", "initial_state")


def make_inputs(
    *sizes: int,
    num_states: int | None = None,
    dtype: Any = jnp.float32,
) -> dict[str, Any]:
    """q, k, v of ``sizes`` (B, S, H, Dk, Dv) in ``dtype``, MiniMax-01 slopes of layer 3 of 8, and an initial state."""
    _, _, h, dk, dv = sizes
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    arrays: dict[str, Any] = {
        **lc.qkv(keys, sizes, dtype),
        "slopes": jnp.asarray(lightning_slopes(h, 3, 8)),
    }
    if num_states is not None:
        arrays["initial_state"] = normal(keys[3], (num_states, h, dk, dv))
    return arrays


#: ``check(arrays, **statics)``: output and gradients of ``ejkernel.lightning_attention`` against the reference
#: (in ``SMALL`` chunks unless ``cfg`` is given); returns ours.
check = functools.partial(
    lc.check_vjp,
    ejkernel.lightning_attention,
    lightning_attention_reference,
    DIFFERENTIABLE,
    cfg=SMALL,
)


def test_slopes_follow_minimax_01() -> None:
    # get_slope_rate of MiniMax-Text-01: 2^(-8(h+1)/H) · (1 - l / (L - 1 + 1e-5) + 1e-5).
    h, layers = 8, 24
    for layer in (0, 11, 23):
        factor = 1 - layer / (layers - 1 + 1e-5) + 1e-5
        want = np.array([2.0 ** (-(i + 1)) for i in range(h)]) * factor
        np.testing.assert_allclose(lightning_slopes(h, layer, layers), want, rtol=1e-6)
    assert lightning_slopes(h, 23, 24).max() < 1e-4  # the last layer barely decays
    np.testing.assert_allclose(
        lightning_slopes(4, 0, 1), 2.0 ** (-2.0 * np.arange(1, 5)) * (1 + 1e-5), rtol=1e-6
    )


def test_layer_index_builds_the_same_slopes_as_given_ones() -> None:
    arrays = make_inputs(2, 37, 4, 16, 24)
    slopes = arrays.pop("slopes")
    by_layer = ejkernel.lightning_attention(**arrays, layer_idx=3, num_layers=8, cfg=SMALL)
    given = ejkernel.lightning_attention(**arrays, slopes=slopes, cfg=SMALL)
    np.testing.assert_array_equal(by_layer, given)
    assert_close(
        by_layer, lightning_attention_reference(**arrays, layer_idx=3, num_layers=8), scale=lc.F32
    )


def test_output_state_and_gradients_match_the_reference() -> None:
    arrays = make_inputs(2, 37, 4, 16, 24, num_states=2)
    arrays["slopes"] = arrays["slopes"] * 8.0  # steep decays too
    (_, final), grads = check(arrays, return_state=True, softmax_scale=1.0)
    assert final.dtype == jnp.float32 and grads["slopes"].shape == (4,)


def test_packed_sequences_with_empty_and_single_token_sequences_reset_states() -> None:
    cu = jnp.asarray([0, 1, 1, 20, 36, 37], jnp.int32)
    arrays = make_inputs(1, 37, 4, 16, 24, num_states=5)
    (_, final), _ = check({**arrays, "cu_seqlens": cu}, return_state=True)
    np.testing.assert_array_equal(final[1], arrays["initial_state"][1])


def test_three_hundred_and_thirty_three_steps_stay_within_1e_4_in_float32() -> None:
    arrays = make_inputs(1, 333, 2, 32, 32, num_states=1)
    check(arrays, cfg=None, return_state=True)


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = make_inputs(2, 37, 4, 16, 24, dtype=jnp.bfloat16)
    out, _ = check(arrays, scale=1.0)
    assert out.dtype == jnp.bfloat16


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = make_inputs(2, 40, 4, 16, 24, num_states=2)
    lc.check_two_halves(
        ejkernel.lightning_attention, arrays, ("query", "key", "value"), 20, cfg=SMALL
    )


def test_jit_and_vmap_of_gradients_match_the_reference() -> None:
    arrays = make_inputs(2, 37, 4, 16, 24)
    ours = functools.partial(ejkernel.lightning_attention, cfg=SMALL)
    lc.check_jit_vmap_grad(ours, lightning_attention_reference, arrays)


def test_explain_reports_the_xla_heuristic_config() -> None:
    arrays = make_inputs(2, 37, 4, 16, 24)
    record = ejkernel.explain(
        "lightning_attention",
        arrays["query"],
        arrays["key"],
        arrays["value"],
        layer_idx=0,
        num_layers=4,
    )
    assert record.platform == "xla" and record.source == "heuristic"
    assert record.config == LightningAttentionConfig(chunk_size=64)


def test_configs_offer_chunks_no_longer_than_the_sequence() -> None:
    inv = lc.linear_invocation(100)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space))
    assert [c.chunk_size for c in space] == [64, 32, 128]


#: A valid call; the bad-input cases change some of its arguments.
VALID = make_inputs(2, 37, 4, 16, 24)


test_bad_inputs_raise_clear_errors_before_any_kernel = lc.rejects_bad_linear_inputs(
    ejkernel.lightning_attention,
    VALID,
    [
        pytest.param(
            {"slopes": None},
            ValueError,
            r"give `slopes` \[H\] or both `layer_idx` and `num_layers`",
            id="no-slopes",
        ),
        pytest.param(
            {"layer_idx": 1, "num_layers": 4},
            ValueError,
            r"give `slopes` or \(`layer_idx`, `num_layers`\), not both",
            id="both",
        ),
        pytest.param(
            {"slopes": jnp.ones((3,))},
            ValueError,
            r"`slopes` must be floating \[H\]",
            id="slopes-H",
        ),
        pytest.param(
            {"slopes": None, "layer_idx": 4, "num_layers": 4},
            ValueError,
            "`layer_idx` must satisfy 0 <= layer_idx < num_layers",
            id="layer-out-of-range",
        ),
        pytest.param(
            {"slopes": None, "layer_idx": 1.0, "num_layers": 4},
            TypeError,
            "`layer_idx` must be an int",
            id="layer-float",
        ),
        pytest.param(
            {"key": jnp.zeros((2, 36, 4, 16))},
            ValueError,
            r"`key` must be \[B, S, H, K\]",
            id="key-S",
        ),
    ],
)
