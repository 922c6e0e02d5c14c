"""The Pallas Mosaic-TPU flash attention in TPU interpret mode on the CPU, against the reference.

Every feature the kernels implement (causal bottom-right, sliding window, soft cap, segment ids,
GQA, odd lengths, head dim 80 padded to 128 lanes, Dv != D), forward and gradients, with small
blocks so every axis has several blocks and padded tails. Shapes stay small: the interpreter
simulates each grid step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.ops import BwdParams, FwdParams, Invocation
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import AttentionShape, assert_close, attention_inputs
from ejkernel.testing import random_normal as normal
from ejkernel_pallas.tpu.flash_attention import (
    FlashAttentionConfig,
    config_space,
    flash_attention_pallas,
    heuristic,
    supports,
)

SQUARE = AttentionShape(b=1, sq=37, sk=37, hq=2, hkv=2, d=80)
GQA = AttentionShape(b=1, sq=129, sk=129, hq=4, hkv=2, d=64)
SHORT_Q = AttentionShape(b=2, sq=37, sk=129, hq=2, hkv=1, d=32)
LONG_Q = AttentionShape(b=1, sq=129, sk=37, hq=2, hkv=1, d=80, dv=48)

#: q blocks of 16 rows (8-sublane multiples), kv blocks of one 128-lane tile.
SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=128),
    bwd_params=BwdParams(q_blocksize=24, kv_blocksize=128),
)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def run(shape: AttentionShape, dtype: Any, cfg: Any, **kwargs: Any) -> None:
    """Output and gradients of the kernels (custom VJP as the executor wires it) vs the oracle."""
    q, k, v = attention_inputs(shape, dtype)
    kwargs.setdefault("softmax_scale", shape.d**-0.5)
    statics = {"causal": False, "sliding_window": None, "logits_soft_cap": None, **kwargs}
    arrays = {n: statics.pop(n) for n in ("q_segment_ids", "kv_segment_ids") if n in statics}

    @jax.custom_vjp
    def ours(q: Any, k: Any, v: Any) -> Any:
        return flash_attention_pallas(query=q, key=k, value=v, cfg=cfg, **arrays, **statics)

    def fwd(q: Any, k: Any, v: Any) -> Any:
        return flash_attention_pallas.fwd(query=q, key=k, value=v, cfg=cfg, **arrays, **statics)

    def bwd(res: Any, d_out: Any) -> Any:
        grads = flash_attention_pallas.bwd(res, d_out, cfg=cfg, **statics)
        return grads["query"], grads["key"], grads["value"]

    ours.defvjp(fwd, bwd)

    def oracle(q: Any, k: Any, v: Any) -> Any:
        return flash_attention_reference(q, k, v, **arrays, **statics)

    out, vjp = jax.vjp(ours, q, k, v)
    d_out = normal(jax.random.PRNGKey(42), out.shape, out.dtype)
    up = lambda x: x.astype(jnp.float32)
    ref_out, ref_vjp = jax.vjp(oracle, up(q), up(k), up(v))
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert_close(out, ref_out, name="out")
    for name, g, r in zip(("dq", "dk", "dv"), vjp(d_out), ref_vjp(up(d_out))):
        assert g.dtype == q.dtype
        assert_close(g, r, name=name)


#: SHORT_Q under a causal mask is the window test's case (causal, window and soft cap at once).
@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [
        (SQUARE, {}),
        (GQA, {"causal": True}),
        (LONG_Q, {"causal": True}),
    ],
    ids=[f"{SQUARE}", f"{GQA}-causal", f"{LONG_Q}-causal-empty-rows"],
)
def test_output_and_gradients_match_the_reference_in_float32(
    shape: AttentionShape, kwargs: Any
) -> None:
    run(shape, jnp.float32, SMALL, **kwargs)


def test_sliding_window_with_causal_and_soft_cap_match_the_reference() -> None:
    run(SHORT_Q, jnp.float32, SMALL, causal=True, sliding_window=(20, 3), logits_soft_cap=2.0)


def test_symmetric_sliding_window_skips_blocks_on_both_sides() -> None:
    run(GQA, jnp.float32, SMALL, sliding_window=(8, 8), softmax_scale=0.3)


def test_segment_ids_with_padding_give_zero_rows_and_match_the_reference() -> None:
    shape = SHORT_Q
    q_seg = np.full((shape.b, shape.sq), -1, np.int32)
    q_seg[:, :10], q_seg[:, 10:30], q_seg[1, 30:33] = 0, 1, 7  # id 7 has no keys
    kv_seg = np.full((shape.b, shape.sk), -1, np.int32)
    kv_seg[:, :50], kv_seg[:, 50:100] = 0, 1
    run(
        shape,
        jnp.float32,
        SMALL,
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
    )


def test_bfloat16_with_default_blocks_matches_the_reference() -> None:
    run(GQA, jnp.bfloat16, None, causal=True, logits_soft_cap=5.0)


def test_the_public_op_runs_the_kernels_under_jit_and_grad_with_platform_pallas() -> None:
    shape = SQUARE
    q, k, v = attention_inputs(shape, jnp.float32, seed=3)
    sel = ejkernel.explain(ejkernel.flash_attention, q, k, v, causal=True, platform="pallas")
    assert sel.platform == "pallas" and "ejkernel_pallas.tpu" in sel.implementation

    def loss(fn: Any, q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(jnp.sin(fn(q, k, v)))

    ours = lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=True, platform="pallas")
    oracle = lambda q, k, v: flash_attention_reference(q, k, v, causal=True)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2))(q, k, v)
    assert_close(got, want, name="value-and-grads")


def test_heuristic_blocks_are_tpu_tiles_and_fit_the_sequence() -> None:
    inv = _inv(GQA)
    cfg = heuristic(inv)
    for params in (cfg.fwd_params, cfg.bwd_params):
        assert params.q_blocksize % 8 == 0 and params.kv_blocksize % 128 == 0
        assert params.q_blocksize <= 136 and params.kv_blocksize <= 256
    space = config_space(inv)
    assert space[0] == cfg and len(space) == len(set(space))


def test_long_sequences_get_vmem_sized_blocks() -> None:
    shape = AttentionShape(b=1, sq=32768, sk=32768, hq=8, hkv=8, d=256)
    q, k, v = jax.eval_shape(lambda: attention_inputs(shape))  # the shapes, no arrays
    inv = Invocation(kernel="flash_attention", kwargs={"query": q, "key": k, "value": v})
    cfg = heuristic(inv)
    assert (cfg.fwd_params.q_blocksize, cfg.fwd_params.kv_blocksize) == (512, 512)
    assert cfg.bwd_params.kv_blocksize <= 512


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ({"bias": jnp.zeros((1, 1, 37, 37))}, "bias"),
        ({"attention_mask": jnp.ones((37, 37), bool)}, "attention_mask"),
        ({"softmax_aux": jnp.zeros((2,))}, "sinks"),
        ({"dropout_prob": 0.1}, "dropout"),
    ],
    ids=["bias", "mask", "sinks", "dropout"],
)
def test_unimplemented_features_are_declined_and_fall_back_to_xla(extra: Any, word: str) -> None:
    inv = _inv(SQUARE, **extra)
    reason = supports(inv)
    assert isinstance(reason, str) and word in reason
    q, k, v = attention_inputs(SQUARE)
    sel = ejkernel.explain(ejkernel.flash_attention, q, k, v, **extra)
    assert sel.platform != "pallas"
    ours = [why for name, why in sel.rejected.items() if name.startswith("pallas")]
    assert any(word in why for why in ours), ours


def _inv(shape: AttentionShape, **kwargs: Any) -> Any:
    q, k, v = attention_inputs(shape)
    return Invocation(kernel="flash_attention", kwargs={"query": q, "key": k, "value": v, **kwargs})
