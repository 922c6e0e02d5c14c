"""XLA flash attention on the GPU: O(S) memory where dense XLA attention runs out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.specs.flash_attention import flash_attention_reference

pytestmark = pytest.mark.gpu


def _inputs(b, s, h, d, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    return [jax.random.normal(k, (b, s, h, d), jnp.float32).astype(dtype) for k in ks]


def _fwd_bwd(attn):
    def f(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return jax.jit(f)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_xla_flash_attention_runs_at_16k_where_dense_xla_attention_does_not_fit(causal):
    q, k, v, do = _inputs(1, 16384, 16, 128)
    ours = _fwd_bwd(
        lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=causal, platform="xla")
    )
    # Dense XLA attention holds at least the [B, H, S, S] float32 scores (16 GiB here: its
    # compile autotunes at that size, too much for a GPU other test processes share).
    scores_bytes = q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * 4
    ours_bytes = ours.lower(q, k, v, do).compile().memory_analysis().temp_size_in_bytes
    assert ours_bytes * 8 < scores_bytes, (ours_bytes, scores_bytes)
    out, (dq, dk, dv) = jax.block_until_ready(ours(q, k, v, do))
    ref = flash_attention_reference(
        *(x[:, :, :1].astype(jnp.float32) for x in (q, k, v)), causal=causal
    )
    err = jnp.linalg.norm(out[:, :, :1].astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert float(err) < 1e-2
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in (dq, dk, dv))


def test_xla_flash_attention_gradients_match_the_reference_on_gpu_in_float32():
    q, k, v, do = _inputs(2, 257, 8, 80, jnp.float32)
    k, v = k[:, :, :2], v[:, :, :2]
    with jax.default_matmul_precision("highest"):
        ours = _fwd_bwd(
            lambda q, k, v: ejkernel.flash_attention(
                q, k, v, causal=True, sliding_window=64, platform="xla"
            )
        )(q, k, v, do)
        ref = _fwd_bwd(
            lambda q, k, v: flash_attention_reference(q, k, v, causal=True, sliding_window=64)
        )(q, k, v, do)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
        assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 1e-4
