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
#: Float32 tolerance multiplier: 1e-5 · 10 = 1e-4 relative to the largest reference value.
F32 = 10.0
DIFFERENTIABLE = ("query", "key", "value", "slopes", "initial_state")


def make_inputs(
    b: int,
    s: int,
    h: int,
    dk: int,
    dv: int,
    *,
    num_states: int | None = None,
    dtype: Any = jnp.float32,
) -> dict[str, Any]:
    """q, k, v (``dtype``), MiniMax-01 slopes of layer 3 of 8, and an initial state."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    arrays: dict[str, Any] = {
        "query": normal(keys[0], (b, s, h, dk), dtype),
        "key": normal(keys[1], (b, s, h, dk), dtype),
        "value": normal(keys[2], (b, s, h, dv), dtype),
        "slopes": jnp.asarray(lightning_slopes(h, 3, 8)),
    }
    if num_states is not None:
        arrays["initial_state"] = normal(keys[3], (num_states, h, dk, dv))
    return arrays


@functools.partial(jax.jit, static_argnames=("statics",))
def reference_vjp(
    arrays: dict[str, Any], cotangent: Any, statics: tuple[tuple[str, Any], ...]
) -> Any:
    """The reference's output and its gradients for ``cotangent`` (jitted: compiled once)."""
    wrt = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}
    rest = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}
    out, vjp = jax.vjp(
        lambda wrt: lightning_attention_reference(**wrt, **rest, **dict(statics)), wrt
    )
    return out, vjp(cotangent)[0]


def check(arrays: dict[str, Any], *, cfg: Any = SMALL, scale: float = F32, **statics: Any) -> Any:
    """Output and gradients of ``ejkernel.lightning_attention`` against the reference."""
    wrt = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}
    rest = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}
    out, vjp = jax.vjp(
        lambda wrt: ejkernel.lightning_attention(**wrt, **rest, cfg=cfg, **statics), wrt
    )
    cotangent = jax.tree.map(lambda o: normal(jax.random.PRNGKey(42), o.shape, o.dtype), out)
    (grads,) = vjp(cotangent)
    ref_out, ref_grads = reference_vjp(arrays, cotangent, tuple(sorted(statics.items())))
    dtype = arrays["query"].dtype
    assert_close(out, ref_out, dtype=dtype, scale=scale, name="out")
    for name, grad in grads.items():
        assert grad.shape == arrays[name].shape and grad.dtype == arrays[name].dtype, name
        assert_close(grad, ref_grads[name], dtype=dtype, scale=scale, name=f"d{name}")
    return out, grads


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
        by_layer, lightning_attention_reference(**arrays, layer_idx=3, num_layers=8), scale=F32
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
    full, full_state = ejkernel.lightning_attention(**arrays, return_state=True, cfg=SMALL)
    tokens = ("query", "key", "value")
    first = {n: x[:, :20] if n in tokens else x for n, x in arrays.items()}
    out1, state = ejkernel.lightning_attention(**first, return_state=True, cfg=SMALL)
    second = {n: arrays[n][:, 20:] for n in tokens}
    out2, state2 = ejkernel.lightning_attention(
        **second, slopes=arrays["slopes"], initial_state=state, return_state=True, cfg=SMALL
    )
    assert_close(jnp.concatenate([out1, out2], axis=1), full, scale=F32)
    assert_close(state2, full_state, scale=F32)


def test_jit_and_vmap_of_gradients_match_the_reference() -> None:
    arrays = make_inputs(2, 37, 4, 16, 24)
    stacked = {n: jnp.stack([x, 0.5 * x]) for n, x in arrays.items()}

    def loss(fn: Any, a: dict[str, Any]) -> Any:
        return jnp.sum(jnp.sin(fn(**a)))

    ours = functools.partial(ejkernel.lightning_attention, cfg=SMALL)
    got = jax.jit(jax.vmap(jax.value_and_grad(functools.partial(loss, ours))))(stacked)
    want = jax.vmap(jax.value_and_grad(functools.partial(loss, lightning_attention_reference)))(
        stacked
    )
    assert_close(got, want, scale=F32)


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
    inv = _Invocation(100)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space))
    assert [c.chunk_size for c in space] == [64, 32, 128]


class _Invocation:
    def __init__(self, s: int) -> None:
        self.kwargs = {
            "query": jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32),
            "cu_seqlens": None,
        }
        self.metadata = {"grad": False}


def _bad(**changes: Any) -> dict[str, Any]:
    arrays = make_inputs(2, 37, 4, 16, 24)
    arrays.update(changes)
    return arrays


@pytest.mark.parametrize(
    ("arrays", "error", "match"),
    [
        (
            _bad(slopes=None),
            ValueError,
            r"^lightning_attention: give `slopes` \[H\] or both `layer_idx` and `num_layers`",
        ),
        (
            _bad(layer_idx=1, num_layers=4),
            ValueError,
            r"^lightning_attention: give `slopes` or \(`layer_idx`, `num_layers`\), not both",
        ),
        (
            _bad(slopes=jnp.ones((3,))),
            ValueError,
            r"^lightning_attention: `slopes` must be floating \[H\]",
        ),
        (
            _bad(slopes=None, layer_idx=4, num_layers=4),
            ValueError,
            r"^lightning_attention: `layer_idx` must satisfy 0 <= layer_idx < num_layers",
        ),
        (
            _bad(slopes=None, layer_idx=1.0, num_layers=4),
            TypeError,
            r"^lightning_attention: `layer_idx` must be an int",
        ),
        (
            _bad(key=jnp.zeros((2, 36, 4, 16))),
            ValueError,
            r"^lightning_attention: `key` must be \[B, S, H, K\]",
        ),
    ],
    ids=["no-slopes", "both", "slopes-H", "layer-out-of-range", "layer-float", "key-S"],
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    arrays: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        ejkernel.lightning_attention(**arrays)
