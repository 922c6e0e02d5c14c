"""The XLA materialised attention against the reference: outputs, weights, gradients, options.

Every call goes through the public ``ejkernel.attention`` (the executor wires the custom VJP);
gradients flow from both outputs, ``out`` and ``weights``, and are compared with ``jax.vjp`` of
:func:`ejkernel.specs.attention.attention_reference`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel.specs.attention import attention_reference
from ejkernel.testing import ATTENTION_SHAPES, AttentionShape, assert_close, attention_inputs
from ejkernel.testing import random_normal as normal

DIFFERENTIABLE = ("query", "key", "value", "bias", "softmax_aux")

SQUARE = ATTENTION_SHAPES[0]  # B2-Sq37-Sk37-Hq4-Hkv4-D80
GQA = ATTENTION_SHAPES[1]  # B1-Sq129-Sk129-Hq8-Hkv2-D64
SHORT_Q = ATTENTION_SHAPES[2]  # B2-Sq37-Sk129-Hq6-Hkv1-D32
LONG_Q = ATTENTION_SHAPES[3]  # B1-Sq129-Sk37-Hq4-Hkv2-D80-Dv48


def check(
    shape: AttentionShape, dtype: Any = jnp.float32, **kwargs: Any
) -> tuple[tuple[Any, Any], dict[str, Any]]:
    """Compare both outputs and every gradient with the reference; return ours."""
    q, k, v = attention_inputs(shape, dtype)
    wrt = {"query": q, "key": k, "value": v}
    wrt.update({n: kwargs.pop(n) for n in DIFFERENTIABLE[3:] if n in kwargs})

    def with_gradients(fn: Any) -> Any:
        @jax.jit  # one compile per shape (the eager reference would compile op by op)
        def run(w: dict[str, Any], cotangents: Any) -> Any:
            outputs, vjp = jax.vjp(lambda w: fn(**w, **kwargs), w)
            return outputs, vjp(cotangents)[0]

        return run

    d_out = normal(
        jax.random.PRNGKey(42), (shape.b, shape.sq, shape.hq, shape.dv or shape.d), dtype
    )
    d_weights = normal(jax.random.PRNGKey(43), (shape.b, shape.hq, shape.sq, shape.sk), dtype)
    (out, weights), grads = with_gradients(ejkernel.attention)(wrt, (d_out, d_weights))
    (ref_out, ref_weights), ref_grads = with_gradients(attention_reference)(wrt, (d_out, d_weights))
    assert out.dtype == weights.dtype == q.dtype
    assert weights.shape == (shape.b, shape.hq, shape.sq, shape.sk)
    assert_close(out, ref_out, name="out")
    assert_close(weights, ref_weights, name="weights")
    helpers.assert_gradients_close(grads, ref_grads)
    return (out, weights), grads


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=str)
def test_outputs_and_gradients_match_the_reference_for_every_shape(shape: AttentionShape) -> None:
    (_, weights), _ = check(shape)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("shape", [SHORT_Q, LONG_Q], ids=str)
def test_causal_sliding_window_and_soft_cap_match_the_reference(shape: AttentionShape) -> None:
    check(shape, causal=True, sliding_window=(20, 3), logits_soft_cap=2.0)


@pytest.mark.parametrize("bias_shape", helpers.BIAS_SHAPES, ids=helpers.shape_id)
def test_bias_and_its_gradient_keep_the_bias_broadcast_shape(bias_shape: tuple[int, ...]) -> None:
    helpers.assert_bias_gradient_keeps_its_shape(functools.partial(check, SHORT_Q), bias_shape)


def test_attention_mask_and_segments_give_zero_rows_with_zero_gradients() -> None:
    shape = SHORT_Q  # Sq=37, Sk=129
    q_seg, kv_seg = helpers.padding_segments(shape.b, shape.sq, shape.sk)
    mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.7, (shape.b, 1, shape.sq, shape.sk))
    (out, weights), grads = check(
        shape,
        attention_mask=mask,
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
        softmax_aux=normal(jax.random.PRNGKey(3), (shape.hq,)),
    )
    blind = helpers.assert_blind_rows_are_zeros(out, grads, q_seg, kv_seg)
    assert np.all(np.asarray(weights).transpose(0, 2, 1, 3)[blind] == 0.0)


def test_rows_before_every_key_are_zeros_without_nan() -> None:
    # Sq > Sk with causal: the first Sq - Sk queries sit before key 0.
    (out, weights), grads = check(LONG_Q, causal=True, softmax_aux=jnp.ones((LONG_Q.hq,)))
    blind = LONG_Q.sq - LONG_Q.sk
    assert np.all(np.asarray(out)[:, :blind] == 0.0)
    assert np.all(np.asarray(weights)[:, :, :blind] == 0.0)
    assert np.all(np.asarray(grads["query"])[:, :blind] == 0.0)
    assert np.all(np.isfinite(np.asarray(grads["softmax_aux"])))


@pytest.mark.parametrize("aux_shape", [(4,), (4, 2)], ids=["sinks-Hq", "sinks-Hq-2"])
def test_sinks_take_probability_mass_and_get_their_gradient(aux_shape: tuple[int, ...]) -> None:
    aux = normal(jax.random.PRNGKey(4), aux_shape) + 1.0
    (_, weights), grads = check(SQUARE, softmax_aux=aux, causal=True)
    assert grads["softmax_aux"].shape == aux_shape
    assert np.all(np.asarray(weights).sum(-1) < 1.0)


def test_dropout_weights_are_the_dropped_matrix_the_output_used() -> None:
    shape = GQA
    (out, weights), _ = check(shape, dropout_prob=0.25, dropout_seed=jnp.uint32(1234), causal=True)
    q, k, v = attention_inputs(shape)
    ref_weights = jax.jit(attention_reference, static_argnames=("dropout_prob", "causal"))(
        q, k, v, dropout_prob=0.25, dropout_seed=jnp.uint32(1234), causal=True
    )[1]
    assert np.array_equal(np.asarray(weights) == 0.0, np.asarray(ref_weights) == 0.0)
    visible = np.tril(np.ones((shape.sq, shape.sk), bool))
    dropped = np.asarray(weights)[:, :, visible] == 0.0
    assert 0.2 < dropped.mean() < 0.3
    manual = jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(v, shape.hq // shape.hkv, axis=2))
    assert_close(out, manual)


def test_dropout_seed_may_be_traced_under_jit() -> None:
    q, k, v = attention_inputs(SQUARE)

    @jax.jit
    def both(seed: Any) -> tuple[Any, Any]:
        ours = ejkernel.attention(q, k, v, dropout_prob=0.3, dropout_seed=seed)
        return ours, attention_reference(q, k, v, dropout_prob=0.3, dropout_seed=seed)

    for seed in (0, 5):
        ours, ref = both(jnp.uint32(seed))
        assert_close(ours, ref)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(LONG_Q, dtype=jnp.bfloat16, causal=True, logits_soft_cap=4.0)


def test_jit_and_vmap_match_the_reference() -> None:
    shape = SHORT_Q
    q, k, v = attention_inputs(shape)
    qs, ks, vs = (jnp.stack([x, 2.0 * x]) for x in (q, k, v))
    kwargs = {"causal": True, "logits_soft_cap": 4.0}

    def loss(fn: Any) -> Any:
        def f(q: Any, k: Any, v: Any) -> Any:
            out, weights = fn(q, k, v, **kwargs)
            return jnp.sum(jnp.sin(out)) + jnp.sum(weights * weights)

        return jax.vmap(jax.value_and_grad(f, argnums=(0, 1, 2)))

    ours = jax.jit(loss(ejkernel.attention))(qs, ks, vs)
    assert_close(ours, jax.jit(loss(attention_reference))(qs, ks, vs))


def test_explain_selects_xla_without_a_config() -> None:
    q, k, v = attention_inputs(SQUARE)
    sel = ejkernel.explain("attention", q, k, v, causal=True)
    assert sel.platform == "xla"
    assert sel.implementation.endswith("attention_xla")
    assert sel.config is None and sel.source == "heuristic"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"key": jnp.ones((2, 37, 3, 80))},
            ValueError,
            r"^attention: `key` must be \[B, Sk, Hkv, D\]",
        ),
        (
            {"value": jnp.ones((2, 5, 4, 80))},
            ValueError,
            r"^attention: `value` must be \[B, Sk, Hkv, Dv\]",
        ),
        (
            {"bias": jnp.ones((3, 37, 37))},
            ValueError,
            r"^attention: `bias` must be floating and broadcastable",
        ),
        (
            {"attention_mask": jnp.ones((37, 37))},
            TypeError,
            r"^attention: `attention_mask` must be bool",
        ),
        (
            {"softmax_aux": jnp.ones((5,))},
            ValueError,
            r"^attention: `softmax_aux` must be floating \[Hq\]",
        ),
        ({"dropout_prob": 1.0}, ValueError, r"^attention: `dropout_prob` must be in \[0, 1\)"),
    ],
    ids=["key-heads", "value-length", "bias-shape", "mask-dtype", "sinks-shape", "dropout-prob"],
)
def test_bad_inputs_raise_clear_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    q, k, v = attention_inputs(SQUARE)
    args = {"query": q, "key": k, "value": v, **kwargs}
    with pytest.raises(error, match=match):
        ejkernel.attention(**args)
