"""The Triton state_space_v1 (the Mamba-1 selective scan on the gla kernels) against the
sequential ``lax.scan`` reference (``state_space_v1_reference``).

Through Triton's interpreter on the CPU: tiny odd shapes, float32 unless said. Marked ``gpu``
(compiled, on the GPU): B 2, T 2048, I 512, N 16 in bfloat16 against the XLA platform in
float32.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton import _linear_helpers as lh

import ejkernel
from ejkernel.specs.state_space_v1 import state_space_v1_reference
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.state_space_v1 import StateSpaceV1Config, heuristic, supports

C16 = StateSpaceV1Config(block_i=4, chunk=16, num_stages=1)
CORE = ("x", "A", "B", "C", "D", "dt")


def inputs(b: int, s: int, i: int, n: int, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    """Every array argument, random (``A < 0``; ``dt`` around 0, for ``dt_softplus``)."""
    ks = jax.random.split(jax.random.PRNGKey(s + 3 * i + n), 9)
    return {
        "x": normal(ks[0], (b, s, i), dtype),
        "A": -jnp.exp(0.5 * normal(ks[1], (i, n), jnp.float32)),
        "B": normal(ks[2], (b, s, n), dtype),
        "C": normal(ks[3], (b, s, n), dtype),
        "D": normal(ks[4], (i,), jnp.float32),
        "dt": normal(ks[5], (b, s, i), jnp.float32) - 1.0,
        "gate": normal(ks[6], (b, s, i), dtype),
        "dt_bias": 0.5 * normal(ks[7], (i,), jnp.float32),
        "initial_state": normal(ks[8], (b, i, n), jnp.float32),
    }


def triton_scan(cfg: Any = C16) -> Any:
    return lambda **kw: ejkernel.state_space_v1(**kw, platform="triton", cfg=cfg)


def test_every_argument_and_gradient_matches_the_sequential_reference(interpret) -> None:
    """Gate, dt_bias, softplus, both states; S 37 over chunks of 16."""
    arrays = inputs(2, 37, 5, 6)
    statics = {"dt_softplus": True, "return_state": True}
    lh.check_against(triton_scan(), state_space_v1_reference, arrays, strict=False, **statics)


def test_bf16_and_the_heuristic_config(interpret) -> None:
    arrays = {n: v for n, v in inputs(1, 19, 3, 4, jnp.bfloat16).items() if n in CORE}
    arrays["dt"] = jax.nn.softplus(arrays["dt"])
    up = jax.tree.map(lambda v: v.astype(jnp.float32), arrays)
    lh.compare(lh.run(triton_scan(None), arrays), lh.run(state_space_v1_reference, up), 2e-2)


def test_two_halves_with_the_carried_state_equal_one_run(interpret) -> None:
    timed = ("x", "B", "C", "dt", "gate")
    lh.check_two_halves(triton_scan(), inputs(1, 30, 3, 4), timed, dt_softplus=True)


def test_decoding_a_few_tokens_takes_the_fused_kernel(interpret) -> None:
    arrays = inputs(2, 4, 3, 5)
    statics = {"dt_softplus": True, "return_state": True}
    lh.check_fused_decode(
        ejkernel.state_space_v1, state_space_v1_reference, heuristic, arrays, **statics
    )


def test_supports_and_opt_in() -> None:
    from ejkernel_triton import plugin

    def call(n: int, dtype: Any = jnp.float32) -> Any:
        x = jax.ShapeDtypeStruct((1, 100, 8), dtype)
        a = jax.ShapeDtypeStruct((8, n), jnp.float32)
        return types.SimpleNamespace(kwargs={"x": x, "A": a})

    assert supports(call(16)) is True
    assert "256" in supports(call(512))
    assert "dtype" in supports(call(16, jnp.int8))
    assert heuristic(call(16)).block_k == 16
    assert "state_space_v1" in plugin.OPS and "state_space_v1" in plugin.OPT_IN


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_forward_and_gradients_match_the_xla_path() -> None:
    arrays = inputs(2, 2048, 512, 16, jnp.bfloat16)
    xla = lambda **kw: ejkernel.state_space_v1(**kw, platform="xla")
    lh.check_against_xla(triton_scan(None), xla, arrays, dt_softplus=True, return_state=True)


def test_kernels_compile_for_hopper_with_a_one_wide_value(monkeypatch, tmp_path) -> None:
    """The heuristic's gla launches at the selective scan's shape (bf16, N 16, V 1), forward
    and backward, compiled for sm_90 on any machine."""
    from ejkernel_triton.ops.state_space_v1 import state_space_v1_triton as op

    arrays = {n: v for n, v in inputs(1, 256, 4, 16, jnp.bfloat16).items() if n in CORE}
    compiled = lh.hopper_launches(monkeypatch, tmp_path, heuristic, op.fwd, op.bwd, arrays)
    lh.assert_launches_fit_hopper(compiled, 9)
