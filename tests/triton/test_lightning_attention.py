"""The Triton lightning_attention (on the gla kernels) against the sequential reference.

Through Triton's interpreter on the CPU: tiny odd shapes, float32 unless said, the chunked
kernels through a small config. Marked ``gpu``: B 2, T 4096, H 16, K = V = 128 in bfloat16
against the XLA platform in float32.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._linear_helpers import check_against, check_against_xla, random_qkv, rel

import ejkernel
from ejkernel.specs.lightning_attention import lightning_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.lightning_attention import LightningAttentionConfig, supports

C16 = LightningAttentionConfig(chunk_size=16, block_k=16, block_v=16, num_stages=1)


def inputs(b: int, s: int, h: int, dk: int, dv: int, dtype: Any = jnp.float32) -> dict[str, Any]:
    """q, k, v and positive slopes, from a fixed key."""
    ks = jax.random.split(jax.random.PRNGKey(s * 3 + dk + dv), 4)
    return {
        **random_qkv(ks, b, s, h, dk, dv, dtype),
        "slopes": jnp.abs(normal(ks[3], (h,), jnp.float32)) + 0.01,
    }


def triton_lightning(cfg: Any) -> Any:
    return lambda **kw: ejkernel.lightning_attention(platform="triton", cfg=cfg, **kw)


def check(arrays: dict[str, jax.Array], cfg: Any, *, tol: float = 1e-4, **statics: Any) -> None:
    """Output, final state and every gradient (the slopes' included) against the reference."""
    check_against(triton_lightning(cfg), lightning_attention_reference, arrays, tol=tol, **statics)


# -- interpreter ----------------------------------------------------------------------------


def test_output_state_and_gradients_match_the_sequential_reference(interpret) -> None:
    a = inputs(2, 37, 3, 16, 24)
    a["initial_state"] = normal(jax.random.PRNGKey(9), (2, 3, 16, 24), jnp.float32)
    check(a, C16, return_state=True, softmax_scale=1.0)


def test_packed_sequences_with_empty_and_length_one_sequences(interpret) -> None:
    # sequences of 1, 0, 20 and 13 tokens; tokens 34.. belong to none (zero output)
    a = inputs(1, 37, 2, 16, 16)
    cu = jnp.array([0, 1, 1, 21, 34], jnp.int32)
    a["initial_state"] = normal(jax.random.PRNGKey(4), (4, 2, 16, 16), jnp.float32)
    check(a, C16, cu_seqlens=cu, return_state=True)


def test_minimax_slopes_from_the_layer_index(interpret) -> None:
    a = inputs(1, 33, 4, 16, 16, dtype=jnp.bfloat16)
    del a["slopes"]
    ours = triton_lightning(C16)(**a, layer_idx=1, num_layers=4)
    want = lightning_attention_reference(**a, layer_idx=1, num_layers=4)
    assert ours.dtype == jnp.bfloat16 and rel(ours, want) < 1e-2


def test_an_infinite_slope_forgets_the_state_at_every_token(interpret) -> None:
    a = inputs(1, 20, 2, 16, 16)
    a["slopes"] = a["slopes"].at[1].set(jnp.inf)
    ours = triton_lightning(C16)(**a)
    want = lightning_attention_reference(**a)
    assert bool(jnp.isfinite(ours).all())
    assert_close(ours, want, name="out")


def test_supports_declines_what_gla_declines() -> None:
    q = jax.ShapeDtypeStruct((1, 40, 2, 16), jnp.float32)
    call = {"query": q, "key": q, "value": q, "slopes": jax.ShapeDtypeStruct((2,), jnp.float32)}
    assert supports(types.SimpleNamespace(kwargs=call)) is True
    big = jax.ShapeDtypeStruct((1, 40, 2, 512), jnp.float32)
    assert "256" in supports(types.SimpleNamespace(kwargs={**call, "query": big, "key": big}))


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_forward_and_gradients_match_the_xla_path() -> None:
    a = inputs(2, 4096, 16, 128, 128, dtype=jnp.bfloat16)
    a["slopes"] = a["slopes"] / 16
    a["initial_state"] = normal(jax.random.PRNGKey(2), (2, 16, 128, 128), jnp.float32)
    xla = lambda **kw: ejkernel.lightning_attention(**kw, platform="xla")
    check_against_xla(triton_lightning(None), xla, a, return_state=True)
