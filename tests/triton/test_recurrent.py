"""The Triton recurrent (on the gla kernels) against the sequential ``lax.scan`` reference.

Through Triton's interpreter on the CPU: tiny odd shapes, float32 unless said, the chunked
kernels through small configs (the fused recurrent path has its own tests). Marked ``gpu``:
B 2, T 4096, H 16, K = V = 128 in bfloat16 against the XLA platform in float32.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._linear_helpers import check_against, check_against_xla, random_qkv

import ejkernel
from ejkernel.specs.recurrent import recurrent_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.recurrent import RecurrentConfig, heuristic, supports

#: chunks of 16 (several chunks at these lengths) and 32 (two sub-chunks), several blocks
#: (the chunked kernels' own coverage is tests/triton/test_gla.py).
C16 = RecurrentConfig(chunk_size=16, block_k=16, block_v=16, num_stages=1)
C32 = RecurrentConfig(chunk_size=32, block_k=16, block_v=32, num_stages=1)


def inputs(b: int, s: int, h: int, dk: int, dv: int, dtype: Any = jnp.float32) -> dict[str, Any]:
    """q, k, v, log-sigmoid gates ``g`` and ``gk``, from a fixed key."""
    ks = jax.random.split(jax.random.PRNGKey(s * 5 + dk + dv), 5)
    return {
        **random_qkv(ks, b, s, h, dk, dv, dtype),
        "g": jax.nn.log_sigmoid(normal(ks[3], (b, s, h), jnp.float32)).astype(dtype),
        "gk": jax.nn.log_sigmoid(normal(ks[4], (b, s, h, dk), jnp.float32)).astype(dtype),
    }


def triton_recurrent(cfg: Any) -> Any:
    return lambda **kw: ejkernel.recurrent(platform="triton", cfg=cfg, **kw)


def check(arrays: dict[str, jax.Array], cfg: Any, *, tol: float = 1e-4, **statics: Any) -> None:
    """Output, final state and every gradient against the reference: by ``assert_close`` in
    float32 and by norm (``tol``) in any dtype."""
    check_against(triton_recurrent(cfg), recurrent_reference, arrays, tol=tol, **statics)


# -- interpreter ----------------------------------------------------------------------------


@pytest.mark.parametrize("gates", [("g",), ("g", "gk")], ids=["g", "g+gk"])
def test_each_gate_form_matches_the_sequential_reference(interpret, gates) -> None:
    a = inputs(2, 37, 2, 16, 24)
    arrays = {n: a[n] for n in ("query", "key", "value", *gates)}
    check(arrays, C16)


def test_reverse_with_initial_state_final_state_and_scale(interpret) -> None:
    a = inputs(2, 45, 2, 16, 32)
    a["initial_state"] = normal(jax.random.PRNGKey(9), (2, 2, 16, 32), jnp.float32)
    check(a, C32, reverse=True, return_state=True, softmax_scale=0.3)


def test_reversed_packed_sequences_with_empty_and_length_one_sequences(interpret) -> None:
    # sequences of 1, 0, 25, 12 and 1 tokens, each reversed on its own; tokens 0 and 40..
    # belong to none (zero output)
    a = inputs(1, 43, 2, 16, 24)
    cu = jnp.array([1, 2, 2, 27, 39, 40], jnp.int32)
    a["initial_state"] = normal(jax.random.PRNGKey(4), (5, 2, 16, 24), jnp.float32)
    check(a, C16, cu_seqlens=cu, reverse=True, return_state=True)
    out = triton_recurrent(C16)(**a, cu_seqlens=cu, reverse=True)
    assert not jnp.any(out[:, 40:]) and not jnp.any(out[:, 0])


def test_bf16_within_a_half_precision_tolerance(interpret) -> None:
    check(inputs(1, 37, 2, 16, 32, dtype=jnp.bfloat16), C32, tol=1e-2, reverse=True)


def test_minus_inf_gates_reset_and_strong_decays_stay_finite(interpret) -> None:
    a = inputs(1, 40, 2, 16, 16)
    a["g"] = a["g"].at[0, 7, 1].set(-jnp.inf)
    a["gk"] = (
        (-20.0 * jax.random.uniform(jax.random.PRNGKey(5), a["gk"].shape)).at[0, 30].set(-jnp.inf)
    )
    check(a, C16, return_state=True)


def test_a_nan_input_stays_in_its_causal_future_both_ways(interpret) -> None:
    a = inputs(1, 37, 2, 16, 16)
    a["key"] = a["key"].at[0, 20, 0, 3].set(jnp.nan)
    for reverse in (False, True):
        ours = triton_recurrent(C16)(**a, reverse=reverse)
        want = recurrent_reference(**a, reverse=reverse)
        assert jnp.array_equal(jnp.isnan(ours), jnp.isnan(want))
        assert_close(ours, want, name="out")


def test_supports_declines_the_value_gate_and_what_gla_declines() -> None:
    q = jax.ShapeDtypeStruct((1, 40, 2, 16), jnp.float32)
    call = {"query": q, "key": q, "value": q, "g": None, "gk": q, "gv": None}
    assert supports(types.SimpleNamespace(kwargs=call)) is True
    assert "gv" in supports(types.SimpleNamespace(kwargs={**call, "gv": q}))
    big = jax.ShapeDtypeStruct((1, 40, 2, 512), jnp.float32)
    assert "256" in supports(types.SimpleNamespace(kwargs={**call, "query": big, "key": big}))


def test_the_heuristic_takes_the_fused_path_for_a_few_tokens_only(monkeypatch) -> None:
    from ejkernel_triton.ops import gla_config

    monkeypatch.setattr(gla_config._launch, "interpreting", lambda: False)

    def cfg(s: int) -> Any:
        q = jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32)
        return heuristic(types.SimpleNamespace(kwargs={"query": q, "value": q}))

    limit = gla_config.FUSED_GPU_MAX_TOKENS
    assert cfg(1).fused and cfg(limit).fused and not cfg(limit + 1).fused
    assert cfg(1).block_v == 16


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_gpu_bf16_forward_and_gradients_match_the_xla_path(reverse: bool) -> None:
    a = inputs(2, 4096, 16, 128, 128, dtype=jnp.bfloat16)
    a["gk"] = a["gk"].astype(jnp.float32) / 16
    a["g"] = a["g"].astype(jnp.float32) / 16
    a["initial_state"] = normal(jax.random.PRNGKey(2), (2, 16, 128, 128), jnp.float32)
    xla = lambda **kw: ejkernel.recurrent(**kw, platform="xla")
    check_against_xla(triton_recurrent(None), xla, a, reverse=reverse, return_state=True)
