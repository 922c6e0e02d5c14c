"""The Triton gla against the sequential ``lax.scan`` reference (``gla_reference``).

Through Triton's interpreter on the CPU: tiny odd shapes, float32 unless said, several chunks
and sub-chunks through small configs. Marked ``gpu`` (compiled, on the GPU): B 2, T 8192, H 16,
K = V = 128 in bfloat16 against the XLA platform in float32 (the sequential reference's
gradient would keep every step's state).
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._linear_helpers import (
    check_against,
    check_against_xla,
    check_config_and_gpu_space,
    hopper_launches,
    rel,
    run,
)

import ejkernel
from ejkernel.specs.gla import gla_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.gla import GlaConfig, config_space, heuristic, supports

#: chunks of 16 (one sub-chunk), 32 (two: the split between sub-chunks) and 64 (four: a query
#: sub-chunk against several earlier ones), several K/V blocks.
C16 = GlaConfig(chunk_size=16, block_k=16, block_v=16, num_stages=1)
C32 = GlaConfig(chunk_size=32, block_k=16, block_v=32, num_stages=1)
C64 = GlaConfig(chunk_size=64, block_k=16, block_v=32, num_stages=1)
SMALL = [pytest.param(C16, id="C16"), pytest.param(C32, id="C32"), pytest.param(C64, id="C64")]
SPLITS = [pytest.param(C32, id="C32"), pytest.param(C64, id="C64")]

GPU_SHAPE = (2, 8192, 16, 128, 128)


def inputs(
    b: int, s: int, h: int, dk: int, dv: int, dtype: Any = jnp.float32, decay: float = 1.0
) -> tuple[jax.Array, ...]:
    """q, k, v and log-sigmoid gates (times ``decay``), from a fixed key."""
    ks = jax.random.split(jax.random.PRNGKey(s * 7 + dk + dv), 4)
    q = normal(ks[0], (b, s, h, dk), dtype)
    k = normal(ks[1], (b, s, h, dk), dtype)
    v = normal(ks[2], (b, s, h, dv), dtype)
    g = decay * jax.nn.log_sigmoid(normal(ks[3], (b, s, h, dk), jnp.float32))
    return q, k, v, g.astype(dtype)


def triton_gla(cfg: Any) -> Any:
    return lambda query, key, value, g, **kw: ejkernel.gla(
        query, key, value, g, platform="triton", cfg=cfg, **kw
    )


def check(
    arrays: dict[str, jax.Array], cfg: Any, *, grads: bool = True, tol: float = 1e-4, **statics
) -> None:
    """Ours against the sequential reference: by ``assert_close`` in float32 and by norm
    (``tol``) in any dtype, output, final state and every gradient."""
    check_against(triton_gla(cfg), gla_reference, arrays, grads=grads, tol=tol, **statics)


# -- interpreter ----------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", SMALL)
@pytest.mark.parametrize(
    "shape",
    [(2, 37, 2, 16, 32), (1, 77, 2, 32, 16), (1, 37, 1, 24, 40)],
    ids=["S37", "S77", "S37-K24-V40"],
)
def test_output_and_gradients_match_the_sequential_reference(interpret, cfg, shape) -> None:
    q, k, v, g = inputs(*shape)
    check({"query": q, "key": k, "value": v, "g": g}, cfg)


def test_initial_state_final_state_and_softmax_scale(interpret) -> None:
    q, k, v, g = inputs(2, 45, 2, 16, 32)
    init = normal(jax.random.PRNGKey(9), (2, 2, 16, 32), jnp.float32)
    arrays = {"query": q, "key": k, "value": v, "g": g, "initial_state": init}
    check(arrays, C32, softmax_scale=0.3, return_state=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_half_precision_within_a_half_precision_tolerance(interpret, dtype) -> None:
    q, k, v, g = inputs(2, 37, 2, 16, 32, dtype=dtype)
    check({"query": q, "key": k, "value": v, "g": g}, C32, tol=1e-2)


@pytest.mark.parametrize("cfg", SPLITS)
def test_log_decays_down_to_minus_20_per_step_stay_finite_and_right(interpret, cfg) -> None:
    q, k, v, _ = inputs(1, 70, 2, 16, 16)
    g = -20.0 * jax.random.uniform(jax.random.PRNGKey(5), q.shape)
    check({"query": q, "key": k, "value": v, "g": g}, cfg, return_state=True)


def test_a_log_gate_of_minus_inf_resets_the_state(interpret) -> None:
    q, k, v, g = inputs(1, 45, 2, 16, 16)
    g = g.at[0, 5, :, :].set(-jnp.inf).at[0, 20, 1, :7].set(-jnp.inf)
    check({"query": q, "key": k, "value": v, "g": g}, C32, return_state=True)


@pytest.mark.parametrize("cfg", SPLITS)
def test_a_nan_input_stays_in_its_causal_future(interpret, cfg) -> None:
    q, k, v, g = inputs(2, 45, 2, 16, 16)
    q = q.at[1, 10, 0, 4].set(jnp.nan)
    k = k.at[0, 20, 0, 3].set(jnp.nan)
    v = v.at[1, 40, 1, 5].set(jnp.nan)
    g = g.at[0, 38, 1, 2].set(jnp.nan)
    ours = triton_gla(cfg)(q, k, v, g)
    want = gla_reference(q, k, v, g)
    assert jnp.array_equal(jnp.isnan(ours), jnp.isnan(want))
    assert_close(ours, want, name="out")


def test_packed_sequences_with_empty_and_length_one_sequences(interpret) -> None:
    # sequences of 1, 0, 39, 30 and 1 tokens; tokens 71.. belong to none (zero output)
    q, k, v, g = inputs(1, 75, 2, 16, 32)
    cu = jnp.array([0, 1, 1, 40, 70, 71], jnp.int32)
    init = normal(jax.random.PRNGKey(4), (5, 2, 16, 32), jnp.float32)
    arrays = {"query": q, "key": k, "value": v, "g": g, "initial_state": init}
    for cfg in (C16, C32):
        check(arrays, cfg, cu_seqlens=cu, return_state=True)
    out = triton_gla(C16)(q, k, v, g, cu_seqlens=cu)
    assert not jnp.any(out[:, 71:])


def test_two_halves_with_the_carried_state_equal_one_run(interpret) -> None:
    q, k, v, g = inputs(2, 66, 2, 16, 32)
    ours = triton_gla(C32)
    whole, final = ours(q, k, v, g, return_state=True)
    first, mid = ours(q[:, :29], k[:, :29], v[:, :29], g[:, :29], return_state=True)
    second, end = ours(
        q[:, 29:], k[:, 29:], v[:, 29:], g[:, 29:], initial_state=mid, return_state=True
    )
    assert_close(jnp.concatenate([first, second], axis=1), whole, name="out")
    assert_close(end, final, name="final")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_vmap_and_its_gradient_equal_one_call_per_index(interpret, packed: bool) -> None:
    q, k, v, g = inputs(2, 37, 2, 16, 16)
    cu = jnp.array([0, 20, 37], jnp.int32) if packed else None
    ours = triton_gla(C16)

    def f(q, k, v, g):
        return ours(q[None], k[None], v[None], g[None], cu_seqlens=cu)[0]

    def loss(fn, *args):
        return jnp.sum(jnp.sin(fn(*args)))

    mapped = jax.vmap(f)(q, k, v, g)
    grads = jax.grad(lambda *a: loss(jax.vmap(f), *a), argnums=(0, 3))(q, k, v, g)
    for i in range(2):
        assert_close(mapped[i], f(q[i], k[i], v[i], g[i]), name="out")
        one = jax.grad(lambda *a: loss(f, *a), argnums=(0, 3))(q[i], k[i], v[i], g[i])
        assert_close(grads[0][i], one[0], name="dq")
        assert_close(grads[1][i], one[1], name="dg")


def test_supports_declines_what_the_kernels_do_not_hold() -> None:
    def call(dk: int, dtype: Any = jnp.float32, vdtype: Any = None) -> Any:
        q = jax.ShapeDtypeStruct((1, 8, 1, dk), dtype)
        v = jax.ShapeDtypeStruct((1, 8, 1, 16), vdtype or dtype)
        return types.SimpleNamespace(kwargs={"query": q, "key": q, "value": v, "g": q})

    assert supports(call(128)) is True
    assert "256" in supports(call(512))
    assert "differ" in supports(call(16, jnp.float32, jnp.bfloat16))


def test_config_checks_its_fields_and_the_space_starts_with_the_heuristic(monkeypatch) -> None:
    fields = ("chunk_size", "block_k")
    inv = check_config_and_gpu_space(monkeypatch, GlaConfig, fields, config_space, heuristic, "g")
    assert heuristic(inv).blocks(128, 128) == (32, 64)  # 32-wide key blocks from K 128 on


def test_kernels_compile_for_hopper_with_matrix_instructions(monkeypatch, tmp_path) -> None:
    """The heuristic's launches (bf16, K = V = 128) compiled for sm_90 on any machine."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import gla

    q = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
    call = {"query": q, "key": q, "value": q, "g": jnp.zeros(q.shape, jnp.float32)}
    compiled_launches = hopper_launches(
        monkeypatch, tmp_path, heuristic, gla._gla_fwd, gla._gla_bwd, call
    )
    assert len(compiled_launches) == 9
    for launch, compiled in compiled_launches:
        mix = _codegen.instruction_mix(compiled.ptx)
        name = launch.kernel.fn.__name__
        if name != "gla_fwd_cumsum_kernel":
            assert any(k.startswith(("wgmma", "mma")) for k in mix), name
        if name == "gla_fwd_h_kernel":  # the walk's tiles by 16-byte copies, the gate's too
            assert "cp.async.ca.shared.global" not in mix and mix["cp.async.cg.shared.global"]
        assert compiled.shared <= 232448, name  # the H100's shared memory per block


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("return_state", [False, True], ids=["out", "state"])
def test_gpu_bf16_forward_and_gradients_match_the_xla_path(return_state: bool) -> None:
    b, s, h, dk, dv = GPU_SHAPE
    q, k, v, g = inputs(b, s, h, dk, dv, dtype=jnp.bfloat16)
    g = g.astype(jnp.float32) / 16  # GLA's gates: log_sigmoid(x) / 16
    arrays = {"query": q, "key": k, "value": v, "g": g}
    if return_state:
        arrays["initial_state"] = normal(jax.random.PRNGKey(2), (b, h, dk, dv), jnp.float32)
    xla = lambda **kw: ejkernel.gla(**kw, platform="xla")
    check_against_xla(triton_gla(None), xla, arrays, return_state=return_state)


@pytest.mark.gpu
def test_gpu_packed_sequences_match_the_xla_path() -> None:
    q, k, v, g = inputs(1, 8192, 16, 128, 128, dtype=jnp.bfloat16)
    g = g.astype(jnp.float32) / 16
    cu = jnp.array([0, 1, 1, 1000, 4097, 8000, 8192], jnp.int32)
    arrays = {"query": q, "key": k, "value": v, "g": g}
    out, got = jax.jit(lambda a: run(triton_gla(None), a, cu_seqlens=cu))(arrays)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), arrays)
    with jax.default_matmul_precision("highest"):
        want, exp = jax.jit(
            lambda a: run(lambda **kw: ejkernel.gla(**kw, platform="xla"), a, cu_seqlens=cu)
        )(up)
    assert rel(out, want) < 2e-2
    for n in got:
        assert rel(got[n], exp[n]) < 2e-2, n
