"""The Triton state_space_v1 (the Mamba-1 selective scan on its scan kernels) against the
sequential ``lax.scan`` reference (``state_space_v1_reference``).

Through Triton's interpreter on the CPU: tiny odd shapes (S not a multiple of the checkpoint
chunk, I not a multiple of the channel block), float32 unless said. Marked ``gpu``
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

from ejkernel_triton.ops.state_space_v1 import (
    StateSpaceV1Config,
    config_space,
    heuristic,
    supports,
)

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


def test_without_the_optional_arguments_over_many_channel_blocks(interpret) -> None:
    """No gate, bias, softplus or states; I 9 in blocks of 2, S 20 in chunks of 8."""
    arrays = {n: v for n, v in inputs(2, 20, 9, 3).items() if n in CORE}
    arrays["dt"] = jax.nn.softplus(arrays["dt"])
    cfg = StateSpaceV1Config(block_i=2, chunk=8, num_warps=1, num_stages=1)
    lh.check_against(triton_scan(cfg), state_space_v1_reference, arrays, strict=False)


def test_a_minus_inf_resets_the_state_and_a_zero_step_passes_it(interpret) -> None:
    """``A = -inf`` entries with ``Δ > 0`` (reset) and ``Δ = 0`` (passed through) at some
    tokens: output, final state and every gradient as the reference's."""
    arrays = {n: v for n, v in inputs(1, 21, 5, 4).items() if n in (*CORE, "initial_state")}
    arrays["A"] = arrays["A"].at[::2, 1].set(-jnp.inf)
    arrays["dt"] = jax.nn.softplus(arrays["dt"]).at[:, 3:6].set(0.0).at[:, 11, 1].set(0.0)
    lh.check_against(
        triton_scan(), state_space_v1_reference, arrays, strict=False, return_state=True
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_half_precision_and_the_heuristic_config(interpret, dtype) -> None:
    arrays = {n: v for n, v in inputs(1, 19, 3, 4, dtype).items() if n in (*CORE, "gate")}
    arrays["dt"] = jax.nn.softplus(arrays["dt"])
    up = jax.tree.map(lambda v: v.astype(jnp.float32), arrays)
    lh.compare(lh.run(triton_scan(None), arrays), lh.run(state_space_v1_reference, up), 2e-2)


def test_vmap_of_the_output_and_the_gradients(interpret) -> None:
    """A vmapped axis over the time-dependent arrays, ``A`` and ``D`` shared."""
    stacked = [inputs(2, 11, 3, 4), inputs(2, 11, 3, 4)]
    stacked[1] = jax.tree.map(lambda v: 0.5 * v, stacked[1])
    timed = ("x", "B", "C", "dt", "gate")
    batch = {n: jnp.stack([stacked[0][n], stacked[1][n]]) for n in timed}
    shared = {n: stacked[0][n] for n in ("A", "D")}

    def loss(fn: Any) -> Any:
        def one(t: dict[str, jax.Array], s: dict[str, jax.Array]) -> Any:
            o = fn(**t, **s, dt_softplus=True)
            return jnp.sum(o * jnp.cos(jnp.arange(o.shape[-1]) * 0.7)), o

        grad = jax.grad(one, argnums=(0, 1), has_aux=True)
        return jax.jit(jax.vmap(grad, in_axes=(0, None)))(batch, shared)

    (got, out), (want, ref) = loss(triton_scan()), loss(state_space_v1_reference)
    assert lh.rel(out, ref) < 1e-5
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert lh.rel(a, e) < 1e-5


def test_two_halves_with_the_carried_state_equal_one_run(interpret) -> None:
    timed = ("x", "B", "C", "dt", "gate")
    lh.check_two_halves(triton_scan(), inputs(1, 30, 3, 4), timed, dt_softplus=True)


def _kernel_names(fn: Any, arrays: dict[str, jax.Array]) -> list[str]:
    """The kernels ``fn`` launches at ``arrays`` (recorded at trace time, not run)."""
    from ejkernel_triton import _codegen

    jax.clear_caches()  # the op is jitted: trace it again under the recorder
    with _codegen.recorded_launches() as record:
        fn(arrays)
    return [one.kernel.fn.__name__ for one in record]


def test_the_forward_and_the_gradient_run_the_scan_kernels(interpret) -> None:
    """A decoding call (a few tokens) included: one forward launch undifferentiated, the
    forward and the backward scan under ``grad``."""
    op = triton_scan(None)
    arrays = {n: v for n, v in inputs(2, 3, 3, 5).items() if n in CORE}
    assert _kernel_names(lambda a: op(**a), arrays) == ["ssm_scan_fwd_kernel"]
    grad = jax.grad(lambda a: jnp.sum(op(**a)))
    assert _kernel_names(grad, arrays) == ["ssm_scan_fwd_kernel", "ssm_scan_bwd_kernel"]


def test_decoding_a_few_tokens_matches_the_reference(interpret) -> None:
    arrays = inputs(2, 4, 3, 5)
    statics = {"dt_softplus": True, "return_state": True}
    got = triton_scan(None)(**arrays, **statics)
    want = state_space_v1_reference(**arrays, **statics)
    for a, e in zip(got, want, strict=True):
        assert lh.rel(a, e) < 1e-5


def test_supports_and_opt_in() -> None:
    from ejkernel_triton import plugin

    def call(n: int, dtype: Any = jnp.float32) -> Any:
        x = jax.ShapeDtypeStruct((1, 100, 8), dtype)
        a = jax.ShapeDtypeStruct((8, n), jnp.float32)
        return types.SimpleNamespace(kwargs={"x": x, "A": a})

    assert supports(call(16)) is True
    assert "256" in supports(call(512))
    assert "dtype" in supports(call(16, jnp.int8))
    assert heuristic(call(16)).block_i == 16
    assert heuristic(call(16)) == config_space(call(16))[0]
    with pytest.raises(ValueError, match="block_i"):
        StateSpaceV1Config(block_i=48)
    assert "state_space_v1" in plugin.OPS and "state_space_v1" not in plugin.OPT_IN


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_forward_and_gradients_match_the_xla_path() -> None:
    arrays = inputs(2, 2048, 512, 16, jnp.bfloat16)
    xla = lambda **kw: ejkernel.state_space_v1(**kw, platform="xla")
    lh.check_against_xla(triton_scan(None), xla, arrays, dt_softplus=True, return_state=True)


@pytest.mark.parametrize(
    ("shape", "block"),
    [((4, 128, 2112, 16), 64), ((1, 64, 64, 256), 8)],
    ids=["B4-S128-I2112-N16", "B1-S64-I64-N256"],
)
def test_kernels_compile_for_hopper_without_spills(monkeypatch, tmp_path, shape, block) -> None:
    """The heuristic's scan launches (bf16, gated, softplus; Mamba's N 16 at the largest
    channel block, and the largest N): the undifferentiated forward's, the custom VJP's
    forward and backward, compiled for sm_90 on any machine, none spilling registers."""
    from ejkernel_triton.ops.state_space_v1 import state_space_v1_triton as op

    names = (*CORE, "gate", "dt_bias")
    arrays = {n: v for n, v in inputs(*shape, jnp.bfloat16).items() if n in names}
    compiled = lh.hopper_launches(
        monkeypatch, tmp_path, heuristic, op.fwd, op.bwd, arrays, primal=op, dt_softplus=True
    )
    lh.assert_launches_fit_hopper(compiled, 3)
    kernels = [launch.kernel.fn.__name__ for launch, _ in compiled]
    assert kernels == ["ssm_scan_fwd_kernel", "ssm_scan_fwd_kernel", "ssm_scan_bwd_kernel"]
    assert {launch.constexprs["BI"] for launch, _ in compiled} == {block}
    for launch, kernel in compiled:
        assert lh.spilled_bytes(kernel.cubin, tmp_path) == 0, launch.kernel.fn.__name__
