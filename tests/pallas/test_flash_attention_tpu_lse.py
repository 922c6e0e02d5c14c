"""The Pallas TPU flash attention's (out, lse) step of ring attention (``ejkernel.plugins.deflse``)
in TPU interpret mode, against the XLA step: the lse in natural log and ``[B, Sq, Hq]``, empty
rows at ``EMPTY_ROW_LSE``, and gradients from statistics the caller gives (those of a two-part
softmax merged by hand, as the ring merges its steps). On a TPU the ring's steps select it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.attention_semantics import EMPTY_ROW_LSE
from ejkernel.ops import BwdParams, FwdParams, flash_attention_lse_step
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_pallas._attention import FlashAttentionConfig

SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=16),
    bwd_params=BwdParams(q_blocksize=16, kv_blocksize=16),
)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


@pytest.mark.slow
def test_pallas_step_matches_the_xla_step_and_takes_merged_statistics() -> None:
    b, s, hq, hkv, d = 1, 37, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q = normal(ks[0], (b, s, hq, d))
    k, v = normal(ks[1], (b, 2 * s, hkv, d)), normal(ks[2], (b, 2 * s, hkv, d))
    seg = jnp.zeros((b, s), jnp.int32).at[0, 30:].set(-1)  # rows seeing no key
    kv_seg = jnp.zeros((b, 2 * s), jnp.int32)
    # Bottom-right causal over 2s keys: every query sees the first half, the second causally.
    halves = [
        {"key": k[:, :s], "value": v[:, :s], "kv_segment_ids": kv_seg[:, :s], "causal": False},
        {"key": k[:, s:], "value": v[:, s:], "kv_segment_ids": kv_seg[:, s:], "causal": True},
    ]
    common = {"query": q, "q_segment_ids": seg}
    parts = []
    for half in halves:
        args = {**common, **half}
        step = flash_attention_lse_step(**args, platform="pallas", cfg=SMALL)
        assert step.platform == "pallas"
        out, lse = step.forward(**args)
        ref_out, ref_lse = flash_attention_lse_step(**args, platform="xla").forward(**args)
        assert lse.shape == (b, s, hq) and lse.dtype == jnp.float32
        assert_close(out, ref_out, name="out")
        assert_close(lse, ref_lse, name="lse")
        assert bool(jnp.all(lse[0, 30:] == EMPTY_ROW_LSE))
        parts.append((step, args, out, lse))
    lses = jnp.stack([jnp.where(p[3] >= EMPTY_ROW_LSE, -jnp.inf, p[3]) for p in parts])
    lse = jax.nn.logsumexp(lses, axis=0)
    weights = jnp.exp(lses - jnp.where(jnp.isneginf(lse), 0.0, lse))
    out = sum(w[..., None] * p[2] for w, p in zip(weights, parts, strict=True))
    lse = jnp.where(jnp.isneginf(lse), EMPTY_ROW_LSE, lse)
    d_out = normal(ks[3], out.shape)
    full = {**common, "key": k, "value": v, "kv_segment_ids": kv_seg, "causal": True}

    def reference(q, k, v):
        return flash_attention_reference(**{**full, "query": q, "key": k, "value": v})

    ref_out, vjp = jax.vjp(reference, q, k, v)
    assert_close(out, ref_out, name="merged out")
    dq, dk, dv = vjp(d_out)
    grads = [p[0].backward(out, lse, d_out, **p[1]) for p in parts]
    assert_close(grads[0]["query"] + grads[1]["query"], dq, name="dquery")
    assert_close(jnp.concatenate([g["key"] for g in grads], axis=1), dk, name="dkey")
    assert_close(jnp.concatenate([g["value"] for g in grads], axis=1), dv, name="dvalue")
