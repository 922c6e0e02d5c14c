"""The Triton state_space_v2 (Mamba-2 SSD on its own kernels, forward and backward; gla's
fused kernel for decoding) against the sequential ``lax.scan`` reference
(``state_space_v2_reference``).

Through Triton's interpreter on the CPU: tiny odd shapes (grouped B/C, S not a chunk
multiple), float32 unless said; the ``forward only`` tests call the op undifferentiated. Marked ``gpu`` (compiled, on the GPU): B 2, T 8192, H 32,
P 64, N 128, G 1 in bfloat16 against the XLA platform in float32.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._linear_helpers import (
    assert_launches_fit_hopper,
    check_against,
    check_against_xla,
    check_fused_decode,
    check_two_halves,
    compare,
    hopper_launches,
    rel,
    run,
)

import ejkernel
from ejkernel.specs.state_space_v2 import state_space_v2_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.state_space_v2 import (
    StateSpaceV2Config,
    config_space,
    heuristic,
    supports,
)

C16 = StateSpaceV2Config(chunk_size=16, block_k=16, block_v=16, num_stages=1)
NAMES = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")


def inputs(
    b: int, s: int, h: int, p: int, g: int, n: int, dtype: Any = jnp.float32
) -> dict[str, jax.Array]:
    """Every array argument, random (``A < 0``; ``dt`` around 0, for ``dt_softplus``)."""
    ks = jax.random.split(jax.random.PRNGKey(s + 3 * h + p), 9)
    return {
        "x": normal(ks[0], (b, s, h, p), dtype),
        "A": -jnp.exp(0.5 * normal(ks[1], (h,), jnp.float32)),
        "B": normal(ks[2], (b, s, g, n), dtype),
        "C": normal(ks[3], (b, s, g, n), dtype),
        "D": normal(ks[4], (h,), jnp.float32),
        "dt": normal(ks[5], (b, s, h), jnp.float32) - 1.0,
        "gate": normal(ks[6], (b, s, h, p), dtype),
        "dt_bias": 0.5 * normal(ks[7], (h,), jnp.float32),
        "initial_state": normal(ks[8], (b, h, p, n), jnp.float32),
    }


def triton_ssd(cfg: Any = C16) -> Any:
    return lambda **kw: ejkernel.state_space_v2(**kw, platform="triton", cfg=cfg)


def test_every_argument_and_gradient_matches_the_sequential_reference(interpret) -> None:
    """Grouped B/C (H 4, G 2), gate, dt_bias, softplus, both states, S 37 over chunks of 16."""
    arrays = inputs(2, 37, 4, 8, 2, 6)
    statics = {"dt_softplus": True, "return_state": True}
    check_against(triton_ssd(), state_space_v2_reference, arrays, strict=False, **statics)


def test_core_arguments_alone_with_the_op_chunk_size(interpret) -> None:
    """No optional arrays (S 21, one group); the op's ``chunk_size`` 20 runs chunks of 16."""
    arrays = {n: v for n, v in inputs(1, 21, 2, 5, 1, 3).items() if n in NAMES[:6]}
    arrays["dt"] = jax.nn.softplus(arrays["dt"])
    ours = lambda **kw: ejkernel.state_space_v2(**kw, platform="triton", chunk_size=20)
    check_against(ours, state_space_v2_reference, arrays, strict=False)


def test_bf16_within_a_half_precision_tolerance(interpret) -> None:
    arrays = inputs(1, 19, 2, 8, 1, 4, jnp.bfloat16)
    up = jax.tree.map(lambda v: v.astype(jnp.float32), arrays)
    statics = {"dt_softplus": True, "return_state": True}
    compare(
        run(triton_ssd(), arrays, **statics),
        run(state_space_v2_reference, up, **statics),
        2e-2,
    )


# -- gradients: the SSD backward kernels ---------------------------------------------------


@pytest.mark.parametrize("chunk", [16, 32], ids=lambda c: f"C{c}")
@pytest.mark.parametrize(
    "shape",
    [(2, 37, 4, 8, 2, 6), (1, 37, 4, 20, 2, 40)],
    ids=lambda s: "B{}-S{}-H{}-P{}-G{}-N{}".format(*s),
)
def test_gradients_match_the_sequential_reference(interpret, shape, chunk) -> None:
    """Every gradient, a final-state cotangent included: grouped B/C (H 4, G 2), S 37 odd
    over chunks of 16 and 32, N and P over several 16-wide blocks (P 20, N 40)."""
    statics = {"dt_softplus": True, "return_state": True}
    check_against(triton_ssd(_cfg(chunk)), state_space_v2_reference, inputs(*shape), **statics)


def test_gradients_without_a_gate_or_a_returned_state(interpret) -> None:
    arrays = inputs(2, 37, 4, 8, 2, 6)
    del arrays["gate"]
    check_against(triton_ssd(_cfg(32)), state_space_v2_reference, arrays, dt_softplus=True)


def test_gradients_of_resets_and_zero_steps_across_chunks(interpret) -> None:
    """Head 1 has ``A = -inf`` (a reset where ``Δ > 0``), ``Δ = 0`` at tokens 14 to 18 (across
    the chunk boundary at 16) and the last; both states, a gate: every gradient finite and the
    reference's (``dt`` at the reset head's zero steps, the reset's edge, relative to itself)."""
    arrays = inputs(2, 37, 2, 8, 1, 6)
    del arrays["dt_bias"]
    arrays["A"] = arrays["A"].at[1].set(-jnp.inf)
    arrays["dt"] = jax.nn.softplus(arrays["dt"]).at[:, 14:19].set(0.0).at[:, -1].set(0.0)
    statics = {"return_state": True}
    got = run(triton_ssd(_cfg(16)), arrays, **statics)
    want = run(state_space_v2_reference, arrays, **statics)
    for leaf in jax.tree.leaves(got):
        assert bool(jnp.isfinite(leaf).all())
    zero = (arrays["dt"] == 0.0)[..., 1]
    edge = lambda v: jnp.where(zero, v[..., 1], 0.0) * 1e-29
    assert rel(edge(got[1]["dt"]), edge(want[1]["dt"])) < 1e-4
    for _, grads in (got, want):
        grads["dt"] = grads["dt"].at[..., 1].set(jnp.where(zero, 0.0, grads["dt"][..., 1]))
    compare(got, want, 1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("chunk", [16, 32], ids=lambda c: f"C{c}")
def test_half_precision_gradients_within_a_half_precision_tolerance(
    interpret, chunk, dtype
) -> None:
    """Grouped B/C, S 37, both states, strong decays (``A`` around -5): every gradient within
    2e-2 of the float32 reference's, in its argument's dtype."""
    arrays = inputs(2, 37, 4, 8, 2, 6, dtype)
    arrays["A"] = 5.0 * arrays["A"]
    up = jax.tree.map(lambda v: v.astype(jnp.float32), arrays)
    statics = {"dt_softplus": True, "return_state": True}
    got = run(triton_ssd(_cfg(chunk)), arrays, **statics)
    compare(got, run(state_space_v2_reference, up, **statics), 2e-2)
    for name, grad in got[1].items():
        assert grad.dtype == arrays[name].dtype, name


def test_vmap_and_its_gradient_equal_one_call_per_index(interpret) -> None:
    """``x``, ``B``, ``C``, ``dt`` mapped over a leading axis of 2, ``A`` and ``D`` shared."""
    arrays = inputs(2, 37, 4, 8, 2, 6)
    ours = triton_ssd(_cfg(16))

    def f(x, b, c, dt, A):
        one = {"x": x[None], "B": b[None], "C": c[None], "dt": dt[None]}
        return ours(**one, A=A, D=arrays["D"], dt_softplus=True)[0]

    def loss(fn, *args):
        return jnp.sum(jnp.sin(fn(*args)))

    mapped = (arrays["x"], arrays["B"], arrays["C"], arrays["dt"])
    vf = jax.vmap(f, in_axes=(0, 0, 0, 0, None))
    grads = jax.grad(lambda *a: loss(vf, *a), argnums=(0, 1, 3, 4))(*mapped, arrays["A"])
    d_a = 0.0
    for i in range(2):
        one = jax.grad(lambda *a: loss(f, *a), argnums=(0, 1, 3, 4))(
            *(v[i] for v in mapped), arrays["A"]
        )
        for name, a, e in zip(("dx", "dB", "ddt"), grads, one, strict=False):
            assert_close(a[i], e, name=name)
        d_a = d_a + one[3]
    assert_close(grads[3], d_a, name="dA")


# -- forward only: the SSD kernels ---------------------------------------------------------


def _cfg(chunk: int) -> StateSpaceV2Config:
    return StateSpaceV2Config(chunk_size=chunk, block_k=16, block_v=16, num_stages=1)


def _kernel_names(fn: Any, arrays: dict[str, jax.Array], **statics: Any) -> list[str]:
    """The kernels ``fn`` launches at ``arrays`` (recorded at trace time, not run)."""
    from ejkernel_triton import _codegen

    jax.clear_caches()  # the op is jitted: trace it again under the recorder
    with _codegen.recorded_launches() as record:
        fn(**arrays, **statics)
    return [one.kernel.fn.__name__ for one in record]


def test_the_forward_and_the_gradient_run_the_ssd_kernels(interpret) -> None:
    """The undifferentiated call, the custom VJP's forward and its backward launch the SSD
    kernels, none of gla's."""
    from ejkernel_triton.ops.state_space_v2 import state_space_v2_triton as op

    arrays = inputs(1, 37, 4, 8, 2, 6)
    statics = {"dt_softplus": True, "return_state": True}
    primal = _kernel_names(lambda **kw: op(**kw, cfg=C16), arrays, **statics)
    assert primal == ["ssd_fwd_h_kernel", "ssd_fwd_o_kernel"]
    out, res = op.fwd(**arrays, **statics, cfg=C16)
    vjp = _kernel_names(lambda **kw: op.fwd(**kw, cfg=C16), arrays, **statics)
    assert vjp == ["ssd_fwd_h_kernel", "ssd_fwd_o_kernel"]
    backward = _kernel_names(lambda **kw: op.bwd(res, out, **kw, cfg=C16), {}, **statics)
    assert backward == ["ssd_bwd_dh_kernel", "ssd_bwd_dx_kernel", "ssd_bwd_dbc_kernel"]


@pytest.mark.parametrize("chunk", [16, 32, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize(
    "shape",
    [(2, 37, 4, 8, 2, 6), (1, 37, 2, 20, 1, 40), (1, 16, 6, 16, 3, 16)],
    ids=lambda s: "B{}-S{}-H{}-P{}-G{}-N{}".format(*s),
)
def test_forward_only_matches_the_sequential_reference(interpret, shape, chunk) -> None:
    """Every argument, both states; grouped B/C, S odd or one chunk, N and P over several
    16-wide blocks (P 20, N 40); float32 within 1e-4."""
    arrays = inputs(*shape)
    statics = {"dt_softplus": True, "return_state": True}
    check_against(triton_ssd(_cfg(chunk)), state_space_v2_reference, arrays, grads=False, **statics)


def test_forward_only_with_the_core_arguments_alone(interpret) -> None:
    arrays = {n: v for n, v in inputs(2, 37, 4, 5, 2, 3).items() if n in NAMES[:6]}
    arrays["dt"] = jax.nn.softplus(arrays["dt"])
    check_against(triton_ssd(_cfg(16)), state_space_v2_reference, arrays, grads=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_forward_only_half_precision_within_a_half_precision_tolerance(interpret, dtype) -> None:
    arrays = inputs(2, 37, 4, 8, 2, 6, dtype)
    up = jax.tree.map(lambda v: v.astype(jnp.float32), arrays)
    statics = {"dt_softplus": True, "return_state": True}
    got = jax.jit(functools.partial(triton_ssd(_cfg(16)), **statics))(**arrays)
    want = state_space_v2_reference(**up, **statics)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    for a, e in zip(got, want, strict=True):
        assert rel(a, e) < 1e-2, rel(a, e)


def test_forward_only_a_of_minus_inf_keeps_no_memory(interpret) -> None:
    """Head 1 has ``A = -inf`` (a reset where ``Δ > 0``, the state passed where ``Δ = 0``)."""
    arrays = inputs(1, 37, 2, 4, 1, 4)
    del arrays["dt_bias"]  # Δ = softplus(dt) ≥ 0 below, as a reset needs
    arrays["A"] = arrays["A"].at[1].set(-jnp.inf)
    arrays["dt"] = jax.nn.softplus(arrays["dt"]).at[:, 5:9].set(0.0)
    statics = {"return_state": True}
    check_against(triton_ssd(_cfg(16)), state_space_v2_reference, arrays, grads=False, **statics)


@pytest.mark.parametrize("where", ["x", "B"])
@pytest.mark.parametrize("t", [5, 21], ids=lambda t: f"t{t}")
def test_forward_only_a_nan_reaches_only_its_own_and_later_outputs(interpret, t, where) -> None:
    """A NaN at token t (chunks of 16) in one channel of ``x`` (that channel's outputs from
    t on are NaN) or in one state channel of ``B`` (every output of the group's heads from t
    on), as in the reference; the rest match it."""
    arrays = inputs(1, 37, 4, 4, 2, 4)
    nan = jnp.zeros(arrays["x"].shape, bool)
    if where == "x":
        arrays["x"] = arrays["x"].at[0, t, 1, 2].set(jnp.nan)
        nan = nan.at[0, t:, 1, 2].set(True)
    else:
        arrays["B"] = arrays["B"].at[0, t, 1, 3].set(jnp.nan)
        nan = nan.at[0, t:, 2:].set(True)
    statics = {"dt_softplus": True}
    got = jax.jit(functools.partial(triton_ssd(_cfg(16)), **statics))(**arrays)
    want = state_space_v2_reference(**arrays, **statics)
    assert bool((jnp.isnan(got) == nan).all())
    assert bool((jnp.isnan(want) == nan).all())
    assert rel(jnp.where(nan, 0.0, got), jnp.where(nan, 0.0, want)) < 1e-4


def test_two_halves_with_the_carried_state_equal_one_run(interpret) -> None:
    arrays = inputs(1, 30, 2, 4, 1, 4)
    del arrays["gate"]
    check_two_halves(triton_ssd(), arrays, ("x", "B", "C", "dt"), dt_softplus=True)


def test_a_of_minus_inf_keeps_no_memory_and_zero_steps_pass_the_state(interpret) -> None:
    """Head 1 has ``A = -inf`` (decay 0 where ``Δ > 0``, 1 where ``Δ = 0``); some ``Δ`` are 0."""
    arrays = {n: v for n, v in inputs(1, 20, 2, 4, 1, 4).items() if n in NAMES[:6]}
    arrays["A"] = arrays["A"].at[1].set(-jnp.inf)
    arrays["dt"] = jax.nn.softplus(arrays["dt"]).at[:, 5:9].set(0.0)
    got = run(triton_ssd(), arrays)
    want = run(state_space_v2_reference, arrays)
    for leaf in jax.tree.leaves(got):
        assert bool(jnp.isfinite(leaf).all())
    # d/dΔ at Δ = 0 on the A = -inf head is the reset's edge (A · …, about 1e29 in both):
    # compared apart, relative to itself
    edge = (slice(None), slice(5, 9), 1)
    assert rel(got[1]["dt"][edge] * 1e-29, want[1]["dt"][edge] * 1e-29) < 1e-4
    for _, grads in (got, want):
        grads["dt"] = grads["dt"].at[edge].set(0.0)
    compare(got, want, 1e-4)


def test_decoding_a_few_tokens_takes_the_fused_kernel(interpret) -> None:
    """S 5 with a carried state: the heuristic's fused recurrent kernel, forward only; its
    gradient goes through the chunked kernels."""
    arrays = inputs(2, 5, 4, 8, 2, 6)
    statics = {"dt_softplus": True, "return_state": True}
    check_fused_decode(
        ejkernel.state_space_v2, state_space_v2_reference, heuristic, arrays, **statics
    )
    check_against(triton_ssd(None), state_space_v2_reference, arrays, strict=False, **statics)


def test_supports_heuristic_and_config_space() -> None:
    def call(n: int, dtype: Any = jnp.float32, chunk: int | None = None) -> Any:
        x = jax.ShapeDtypeStruct((1, 100, 2, 16), dtype)
        b = jax.ShapeDtypeStruct((1, 100, 1, n), dtype)
        return types.SimpleNamespace(kwargs={"x": x, "B": b, "C": b, "chunk_size": chunk})

    assert supports(call(128)) is True
    assert "256" in supports(call(512))
    assert "dtype" in supports(call(16, jnp.int8))
    assert heuristic(call(16, chunk=256)).chunk_size == 64
    assert heuristic(call(16, chunk=8)).chunk_size == 16
    space = config_space(call(16))
    assert space[0] == heuristic(call(16)) and len(space) == len(set(space))


def test_it_is_registered_above_the_xla_fallback() -> None:
    from ejkernel_triton import plugin

    assert "state_space_v2" in plugin.OPS and "state_space_v2" not in plugin.OPT_IN


def test_kernels_compile_for_hopper_at_the_mamba2_head_size(monkeypatch, tmp_path) -> None:
    """The heuristic's launches at SSD's shape (bf16, P 64, N 128, G 1): the undifferentiated
    forward's and the custom VJP's (the SSD kernels, forward and backward), compiled for sm_90
    on any machine."""
    from ejkernel_triton.ops.state_space_v2 import state_space_v2_triton as op

    arrays = {n: v for n, v in inputs(1, 256, 2, 64, 1, 128, jnp.bfloat16).items()}
    arrays = {n: v for n, v in arrays.items() if n in NAMES[:6]}
    compiled = hopper_launches(
        monkeypatch, tmp_path, heuristic, op.fwd, op.bwd, arrays, primal=op, dt_softplus=True
    )
    assert_launches_fit_hopper(compiled, 7)
    names = [launch.kernel.fn.__name__ for launch, _ in compiled]
    forward = ["ssd_fwd_h_kernel", "ssd_fwd_o_kernel"]
    assert names == [
        *forward,
        *forward,
        "ssd_bwd_dh_kernel",
        "ssd_bwd_dx_kernel",
        "ssd_bwd_dbc_kernel",
    ]


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("return_state", [False, True], ids=["out", "state"])
def test_gpu_bf16_forward_and_gradients_match_the_xla_path(return_state: bool) -> None:
    arrays = inputs(2, 8192, 32, 64, 1, 128, jnp.bfloat16)
    if not return_state:
        del arrays["initial_state"]
    xla = lambda **kw: ejkernel.state_space_v2(**kw, platform="xla")
    check_against_xla(triton_ssd(None), xla, arrays, dt_softplus=True, return_state=return_state)
