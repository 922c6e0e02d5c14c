"""The XLA flash attention against the reference: outputs, gradients, masks, sinks, dropout.

Gradients go through ``jax.custom_vjp`` built from ``fn.fwd``/``fn.bwd`` the way the executor
builds it: static arguments closed over, array arguments passed as arguments.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import ATTENTION_SHAPES, AttentionShape, assert_close, attention_inputs
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.flash_attention import (
    FlashAttentionConfig,
    config_space,
    flash_attention_xla,
    heuristic,
    scaled_dot_product_attention_xla,
)

ARRAY_ARGS = (
    "query",
    "key",
    "value",
    "bias",
    "attention_mask",
    "q_segment_ids",
    "kv_segment_ids",
    "softmax_aux",
    "dropout_seed",
)
DIFFERENTIABLE = ("query", "key", "value", "bias", "softmax_aux")
STATICS = ("softmax_scale", "causal", "sliding_window", "logits_soft_cap", "dropout_prob")

#: The oracle, compiled once per configuration (op-by-op it dominates the file's runtime).
oracle = jax.jit(flash_attention_reference, static_argnames=STATICS)

SQUARE = ATTENTION_SHAPES[0]  # B2-Sq37-Sk37-Hq4-Hkv4-D80
GQA = ATTENTION_SHAPES[1]  # B1-Sq129-Sk129-Hq8-Hkv2-D64
SHORT_Q = ATTENTION_SHAPES[2]  # B2-Sq37-Sk129-Hq6-Hkv1-D32
LONG_Q = ATTENTION_SHAPES[3]  # B1-Sq129-Sk37-Hq4-Hkv2-D80-Dv48


def blocks(fwd: tuple[int, int], bwd: tuple[int, int] | None = None) -> FlashAttentionConfig:
    bwd = bwd or fwd
    return FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=fwd[0], kv_blocksize=fwd[1]),
        bwd_params=BwdParams(q_blocksize=bwd[0], kv_blocksize=bwd[1]),
    )


#: Blocks shorter than every test sequence: several blocks per axis, padded tails.
SMALL = blocks((16, 32), (32, 16))


def with_defaults(shape: AttentionShape, **kwargs: Any) -> dict[str, Any]:
    """Every argument the core would pass, as it normalises them."""
    args: dict[str, Any] = dict.fromkeys(ARRAY_ARGS[3:])
    args.update(
        softmax_scale=shape.d**-0.5,
        causal=False,
        sliding_window=None,
        logits_soft_cap=None,
        dropout_prob=0.0,
    )
    args.update(kwargs)
    return args


def executor_style(fn: Any, statics: dict[str, Any], names: tuple[str, ...]) -> Any:
    """``jax.custom_vjp`` of ``fn`` from ``fn.fwd``/``fn.bwd``; arrays are its arguments."""

    @jax.custom_vjp
    def call(*arrays: Any) -> Any:
        return fn(**dict(zip(names, arrays)), **statics)

    def fwd(*arrays: Any) -> Any:
        return fn.fwd(**dict(zip(names, arrays)), **statics)

    def bwd(residuals: Any, d_out: Any) -> tuple[Any, ...]:
        grads = fn.bwd(residuals, d_out, **statics)
        return tuple(grads.get(name) for name in names)

    call.defvjp(fwd, bwd)
    return call


def run(
    fn: Any, q: Any, k: Any, v: Any, args: dict[str, Any], cfg: Any
) -> tuple[Any, dict[str, Any], Any]:
    """Output of ``fn``, its gradients for a fixed cotangent, and the cotangent."""
    arrays = {"query": q, "key": k, "value": v}
    arrays.update({n: args[n] for n in ARRAY_ARGS[3:] if args.get(n) is not None})
    statics = {n: x for n, x in args.items() if n not in ARRAY_ARGS}
    call = executor_style(fn, {**statics, "cfg": cfg}, tuple(arrays))
    out, vjp = jax.vjp(call, *arrays.values())
    d_out = normal(jax.random.PRNGKey(42), out.shape, out.dtype)
    grads = dict(zip(arrays, vjp(d_out)))
    return out, {n: g for n, g in grads.items() if n in DIFFERENTIABLE}, d_out


def reference(q: Any, k: Any, v: Any, args: dict[str, Any], d_out: Any) -> tuple[Any, Any]:
    """The oracle's output and its gradients (jax.vjp of the reference) for ``d_out``."""
    wrt = {n: args[n] for n in DIFFERENTIABLE[3:] if args.get(n) is not None}
    rest = {n: x for n, x in args.items() if n not in wrt}

    def f(q: Any, k: Any, v: Any, wrt: dict[str, Any]) -> Any:
        return flash_attention_reference(q, k, v, **rest, **wrt)

    @jax.jit
    def out_and_grads(q: Any, k: Any, v: Any, wrt: dict[str, Any], d_out: Any) -> Any:
        out, vjp = jax.vjp(f, q, k, v, wrt)
        return out, vjp(d_out.astype(out.dtype))

    out, (dq, dk, dv, dwrt) = out_and_grads(q, k, v, wrt, d_out)
    return out, {"query": dq, "key": dk, "value": dv, **dwrt}


def check(
    shape: AttentionShape,
    cfg: FlashAttentionConfig | None = None,
    dtype: Any = jnp.float32,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """Compare output and gradients with the reference; return ours."""
    q, k, v = attention_inputs(shape, dtype)
    args = with_defaults(shape, **kwargs)
    out, grads, d_out = run(flash_attention_xla, q, k, v, args, cfg)
    expected = reference(q, k, v, args, d_out)
    helpers.assert_output_and_gradients_close(out, grads, expected, q.dtype)
    return out, grads


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=str)
def test_output_and_gradients_match_the_reference_for_every_shape(shape: AttentionShape) -> None:
    check(shape)


@pytest.mark.parametrize("shape", [GQA, LONG_Q, ATTENTION_SHAPES[4]], ids=str)
def test_small_blocks_with_padded_tails_match_the_reference(shape: AttentionShape) -> None:
    check(shape, SMALL, logits_soft_cap=5.0)


@pytest.mark.parametrize(
    ("shape", "cfg"),
    [(SQUARE, SMALL), (SHORT_Q, SMALL), (LONG_Q, None)],
    ids=[f"{SQUARE}-small-blocks", f"{SHORT_Q}-small-blocks", f"{LONG_Q}-default-blocks"],
)
def test_causal_is_bottom_right_aligned(shape: AttentionShape, cfg: Any) -> None:
    check(shape, cfg, causal=True)


@pytest.mark.parametrize(
    ("window", "causal"),
    [((8, 8), False), ((20, 3), True)],
    ids=["symmetric-8", "left20-right3-causal"],
)
def test_sliding_window_matches_the_reference(window: tuple[int, int], causal: bool) -> None:
    check(SHORT_Q, SMALL, sliding_window=window, causal=causal)


def test_logits_soft_cap_matches_the_reference() -> None:
    check(GQA, logits_soft_cap=1.5, causal=True)


@pytest.mark.parametrize("bias_shape", helpers.BIAS_SHAPES, ids=helpers.shape_id)
def test_bias_and_its_gradient_keep_the_bias_broadcast_shape(bias_shape: tuple[int, ...]) -> None:
    helpers.assert_bias_gradient_keeps_its_shape(
        functools.partial(check, SHORT_Q, SMALL), bias_shape
    )


def test_attention_mask_matches_the_reference() -> None:
    shape = SQUARE
    mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.6, (shape.b, 1, shape.sq, shape.sk))
    check(shape, SMALL, attention_mask=mask, causal=True)


def test_padding_segments_give_zero_rows_and_zero_gradients() -> None:
    shape = SHORT_Q  # Sq=37, Sk=129
    q_seg, kv_seg = helpers.padding_segments(shape.b, shape.sq, shape.sk)
    out, grads = check(
        shape,
        SMALL,
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
        softmax_aux=normal(jax.random.PRNGKey(3), (shape.hq,)),
    )
    helpers.assert_blind_rows_are_zeros(out, grads, q_seg, kv_seg)


def test_rows_before_every_key_are_zeros_without_nan() -> None:
    # Sq > Sk with causal: the first Sq - Sk queries sit before key 0.
    out, grads = check(LONG_Q, SMALL, causal=True)
    blind = LONG_Q.sq - LONG_Q.sk
    assert np.all(np.asarray(out)[:, :blind] == 0.0)
    assert np.all(np.asarray(grads["query"])[:, :blind] == 0.0)


@pytest.mark.parametrize(
    ("aux_shape", "cfg"),
    [((4,), None), ((4, 2), SMALL)],
    ids=["sinks-Hq-default-blocks", "sinks-Hq-2-small-blocks"],
)
def test_sinks_and_their_gradient_match_the_reference(aux_shape: tuple[int, ...], cfg: Any) -> None:
    aux = normal(jax.random.PRNGKey(4), aux_shape) + 1.0
    _, grads = check(SQUARE, cfg, softmax_aux=aux, causal=True)
    assert grads["softmax_aux"].shape == aux_shape


@pytest.mark.parametrize("cfg", [None, SMALL], ids=["default-blocks", "small-blocks"])
def test_dropout_and_its_gradient_match_the_reference(cfg: Any) -> None:
    check(GQA, cfg, dropout_prob=0.25, dropout_seed=jnp.uint32(1234), causal=True)


def test_dropout_drops_exactly_the_reference_entries() -> None:
    # With value = identity over keys, the output row is the dropped probability row itself.
    shape = AttentionShape(b=2, sq=37, sk=37, hq=4, hkv=2, d=16, dv=37)
    q, k, _ = attention_inputs(shape)
    eye = jnp.eye(shape.sk)[None, :, None, :]
    v = jnp.broadcast_to(eye, (shape.b, shape.sk, shape.hkv, shape.sk))
    args = with_defaults(shape, dropout_prob=0.5, dropout_seed=jnp.uint32(99))
    probs = flash_attention_xla(query=q, key=k, value=v, cfg=SMALL, **args)
    ref = oracle(q, k, v, **args)
    assert np.array_equal(np.asarray(probs) == 0.0, np.asarray(ref) == 0.0)
    assert 0.4 < float(jnp.mean(ref == 0.0)) < 0.6
    assert_close(probs, ref)


def test_dropout_seed_may_be_traced_under_jit() -> None:
    shape = SQUARE
    q, k, v = attention_inputs(shape)
    args = with_defaults(shape, dropout_prob=0.3)
    del args["dropout_seed"]

    @jax.jit
    def both(seed: Any) -> tuple[Any, Any]:
        ours = flash_attention_xla(query=q, key=k, value=v, dropout_seed=seed, cfg=SMALL, **args)
        return ours, flash_attention_reference(q, k, v, dropout_seed=seed, **args)

    for seed in (0, 5):
        ours, ref = both(jnp.uint32(seed))
        assert_close(ours, ref)


@pytest.mark.parametrize("shape", [LONG_Q], ids=str)
def test_bfloat16_matches_the_float32_reference(shape: AttentionShape) -> None:
    check(shape, SMALL, dtype=jnp.bfloat16, causal=True)


def test_jit_and_vmap_match_the_reference() -> None:
    shape = SHORT_Q
    q, k, v = attention_inputs(shape)
    qs, ks, vs = (jnp.stack([x, 2.0 * x]) for x in (q, k, v))
    args = with_defaults(shape, causal=True, logits_soft_cap=4.0)
    statics = {n: x for n, x in args.items() if n not in ARRAY_ARGS}
    call = executor_style(flash_attention_xla, {**statics, "cfg": SMALL}, ("query", "key", "value"))
    loss = lambda q, k, v: jnp.sum(jnp.sin(call(q, k, v)))
    ref_loss = lambda q, k, v: jnp.sum(jnp.sin(flash_attention_reference(q, k, v, **args)))
    ours = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))(qs, ks, vs)
    expected = jax.jit(jax.vmap(jax.value_and_grad(ref_loss, argnums=(0, 1, 2))))(qs, ks, vs)
    assert_close(ours, expected)


def test_scaled_dot_product_attention_matches_the_reference() -> None:
    shape = SHORT_Q
    q, k, v = attention_inputs(shape)
    bias = normal(jax.random.PRNGKey(5), (1, shape.hq, 1, shape.sk))
    args = with_defaults(shape, bias=bias, causal=True, sliding_window=(30, 5))
    for name in ("softmax_aux", "dropout_seed", "dropout_prob"):
        del args[name]
    out, grads, d_out = run(scaled_dot_product_attention_xla, q, k, v, args, SMALL)
    ref_out, ref_grads = reference(q, k, v, args, d_out)
    assert_close(out, ref_out, name="out")
    assert_close(grads, {n: ref_grads[n] for n in grads})


def test_backward_memory_stays_linear_in_sequence_length() -> None:
    shape = jax.ShapeDtypeStruct((1, 16384, 1, 32), jnp.float32)
    args = with_defaults(AttentionShape(b=1, sq=16384, sk=16384, hq=1, hkv=1, d=32), causal=True)
    statics = {n: x for n, x in args.items() if n not in ARRAY_ARGS}
    call = executor_style(flash_attention_xla, {**statics, "cfg": None}, ("query", "key", "value"))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(call(q, k, v)), argnums=(0, 1, 2)))
    memory = grad.lower(shape, shape, shape).compile().memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    dense_logits = 16384 * 16384 * 4
    assert memory.temp_size_in_bytes < dense_logits / 8


class _Invocation:
    def __init__(self, shape: AttentionShape, grad: bool = True) -> None:
        q, k, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in attention_inputs(shape))
        self.kwargs = {"query": q, "key": k}
        self.metadata = {"grad": grad}


@pytest.mark.parametrize("shape", [ATTENTION_SHAPES[4], GQA], ids=str)
def test_configs_never_use_blocks_longer_than_the_sequence(shape: AttentionShape) -> None:
    inv = _Invocation(shape)
    space = config_space(inv)
    assert space[0] == heuristic(inv)
    assert len(space) == len(set(space)) and 1 <= len(space) <= 8
    for cfg in space:
        for params in (cfg.fwd_params, cfg.bwd_params):
            assert 1 <= params.q_blocksize <= shape.sq
            assert 1 <= params.kv_blocksize <= shape.sk
