"""The Triton kernel_delta_attention against the sequential ``lax.scan`` reference
(``kernel_delta_attention_reference``) and a plain NumPy loop over tokens.

Through Triton's interpreter on the CPU: tiny odd shapes (T 37, K 16, V 32, H 2), float32
unless said, several chunks and V blocks through small configs, both gate forms (per key
channel: Kimi Delta Attention; per head: Gated DeltaNet), gradients of every input (the
Triton backward kernels) against autodiff of the reference. Marked ``gpu`` (compiled, on the
GPU): B 2, T 8192, H 16, K = V = 128 in bfloat16 against the XLA platform in float32.
"""

from __future__ import annotations

import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.triton._linear_helpers import check_against, check_config_and_gpu_space, rel

import ejkernel
from ejkernel.specs.kernel_delta_attention import kernel_delta_attention_reference as reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops import kernel_delta_attention as kda_op
from ejkernel_triton.ops.kernel_delta_attention import (
    KernelDeltaAttentionConfig,
    config_space,
    heuristic,
    supports,
)

#: one chunk of 16 with two V blocks; chunks of 32 and 64 with one (a per-channel gate's
#: decayed products: one diagonal block of 16 at C16, off-diagonal products from C32 on).
C16 = KernelDeltaAttentionConfig(chunk_size=16, block_v=16)
C32 = KernelDeltaAttentionConfig(chunk_size=32, block_v=32)
C64 = KernelDeltaAttentionConfig(chunk_size=64, block_v=32)
#: the fused recurrent kernel (decoding), two value blocks of 16
FUSED = KernelDeltaAttentionConfig(block_v=16, fused=True)
SHAPE = (2, 37, 2, 16, 32)
GPU_SHAPE = (2, 8192, 16, 128, 128)


def inputs(
    b: int,
    s: int,
    h: int,
    dk: int,
    dv: int,
    *,
    vector: bool = True,
    dtype: Any = jnp.float32,
    decay: float = 1.0,
) -> dict[str, jax.Array]:
    """q, k, v, ``beta`` in (0, 1) and log-sigmoid gates (times ``decay``), per key channel
    (``vector``) or per head, from a fixed key."""
    ks = jax.random.split(jax.random.PRNGKey(s * 7 + dk + dv), 5)
    gshape = (b, s, h, dk) if vector else (b, s, h)
    return {
        "query": normal(ks[0], (b, s, h, dk), dtype),
        "key": normal(ks[1], (b, s, h, dk), dtype),
        "value": normal(ks[2], (b, s, h, dv), dtype),
        "beta": jax.nn.sigmoid(normal(ks[3], (b, s, h), jnp.float32)).astype(dtype),
        "g": (decay * jax.nn.log_sigmoid(normal(ks[4], gshape, jnp.float32))).astype(dtype),
    }


def triton_kda(cfg: Any) -> Any:
    return lambda **kw: ejkernel.kernel_delta_attention(**kw, platform="triton", cfg=cfg)


def check(
    arrays: dict[str, jax.Array],
    cfg: Any,
    *,
    tol: float = 1e-4,
    grads: bool = False,
    **statics: Any,
) -> None:
    """Output (and final state; with ``grads`` every input's gradient) against the reference:
    ``assert_close`` in float32, by norm (``tol``) in any dtype."""
    strict = arrays["query"].dtype == jnp.float32
    check_against(
        triton_kda(cfg), reference, arrays, grads=grads, tol=tol, strict=strict, **statics
    )


def numpy_scan(a: dict[str, Any], scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token in float64 NumPy (L2-normalised q and k)."""
    q, k, v, beta, g = (
        np.asarray(a[n], np.float64) for n in ("query", "key", "value", "beta", "g")
    )
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * scale
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    g = g if g.ndim == 4 else np.broadcast_to(g[..., None], k.shape)
    b, s, h, dk = q.shape
    state = np.zeros((b, h, dk, v.shape[-1]))
    out = np.zeros(v.shape)
    for t in range(s):
        state = state * np.exp(g[:, t])[..., None]
        err = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + k[:, t][..., None] * (beta[:, t][..., None] * err)[..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out, state


# -- interpreter ----------------------------------------------------------------------------


@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_both_gate_forms_match_a_numpy_token_loop(interpret, vector: bool) -> None:
    arrays = inputs(*SHAPE, vector=vector)
    out, final = triton_kda(C16)(**arrays, return_state=True)
    want, state = numpy_scan(arrays, SHAPE[3] ** -0.5)
    assert rel(out, want) < 1e-5 and rel(final, state) < 1e-5


@pytest.mark.parametrize(
    ("cfg", "vector"), [(C16, True), (C32, False)], ids=["C16-channel-gate", "C32-head-gate"]
)
def test_state_and_scale_match_the_reference(interpret, cfg: Any, vector: bool) -> None:
    arrays = inputs(*SHAPE, vector=vector)
    arrays["initial_state"] = normal(jax.random.PRNGKey(9), (2, 2, 16, 32), jnp.float32)
    check(arrays, cfg, softmax_scale=0.3, return_state=True)


def test_without_the_l2_norm(interpret) -> None:
    arrays = inputs(1, 37, 2, 16, 16)
    arrays["query"] = arrays["query"] * 0.3
    arrays["key"] = arrays["key"] * 0.3
    check(arrays, C16, use_qk_l2norm=False, softmax_scale=0.2, return_state=True)


def test_half_precision_within_a_half_precision_tolerance(interpret) -> None:
    check(inputs(*SHAPE, dtype=jnp.bfloat16), C16, tol=1e-2, grads=True, return_state=True)


@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_narrow_products_within_a_half_precision_tolerance(interpret, vector: bool) -> None:
    # the forward's products on bf16 operands, over two chunks of 32 and an odd tail
    cfg = attrs.evolve(C32, narrow_products=True)
    arrays = inputs(2, 77, 2, 16, 32, vector=vector, dtype=jnp.bfloat16)
    check(arrays, cfg, tol=1e-2, grads=True, return_state=True)


@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_narrow_states_within_a_half_precision_tolerance(interpret, vector: bool) -> None:
    """``narrow_states``: the starting states, ``V'`` and the state gradients the backward
    reads kept in bf16, over chunks of 64 and an odd tail, with an initial state."""
    cfg = attrs.evolve(C64, narrow_states=True)
    arrays = inputs(1, 150, 2, 32, 32, vector=vector, dtype=jnp.bfloat16)
    arrays["initial_state"] = normal(jax.random.PRNGKey(8), (1, 2, 32, 32), jnp.float32)
    check(arrays, cfg, tol=1e-2, grads=True, return_state=True)
    # the residuals the backward reads are bf16; float32 inputs keep them float32
    from ejkernel_triton import _codegen

    for dtype, want in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)):
        call = {n: a.astype(dtype) for n, a in inputs(1, 70, 2, 16, 16, vector=vector).items()}
        jax.clear_caches()  # the forward is jitted: trace it under the recorder
        with _codegen.recorded_launches() as record:
            out, res = kda_op._kda_fwd(cfg=cfg, **call)
            kda_op._kda_bwd(res, out, cfg=cfg)
        shapes = {one.kernel.fn.__name__: one.out_shape for one in record}
        hs, vn = shapes["kda_fwd_h_kernel"][1:3]
        assert hs.dtype == vn.dtype == shapes["kda_bwd_dh_kernel"][0].dtype == want


@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_log_decays_down_to_minus_20_per_step_stay_finite_and_right(interpret, vector) -> None:
    arrays = inputs(1, 40, 2, 16, 16, vector=vector)
    arrays["g"] = -20.0 * jax.random.uniform(jax.random.PRNGKey(5), arrays["g"].shape)
    check(arrays, C32, grads=True, return_state=True)


def test_chunks_of_64_with_strong_and_weak_channels_match_the_reference(interpret) -> None:
    """Four blocks of 16 per chunk: channels decaying by up to 20 per step beside channels that
    barely decay, gradients included."""
    arrays = inputs(1, 70, 2, 16, 16)
    strong = -20.0 * jax.random.uniform(jax.random.PRNGKey(6), arrays["g"].shape)
    arrays["g"] = jnp.where(jnp.arange(16) % 3 == 0, strong, arrays["g"] * 0.01)
    check(arrays, C64, grads=True, return_state=True)


def test_chunks_of_64_with_a_per_head_gate_match_the_reference(interpret) -> None:
    """Four diagonal blocks of ``I + A`` inverted one at a time in the per-head kernel's own
    room, then merged twice."""
    check(inputs(1, 70, 2, 16, 16, vector=False), C64, grads=True, return_state=True)


def test_a_log_gate_of_minus_inf_resets_the_state(interpret) -> None:
    arrays = inputs(1, 37, 2, 16, 16)
    arrays["g"] = arrays["g"].at[0, 5].set(-jnp.inf).at[0, 20, 1, :7].set(-jnp.inf)
    check(arrays, C16, grads=True, return_state=True)


def test_a_nan_input_stays_in_its_causal_future(interpret) -> None:
    arrays = inputs(2, 37, 2, 16, 16)
    arrays["query"] = arrays["query"].at[1, 10, 0, 4].set(jnp.nan)
    arrays["key"] = arrays["key"].at[0, 20, 0, 3].set(jnp.nan)
    arrays["value"] = arrays["value"].at[1, 30, 1, 5].set(jnp.nan)
    arrays["beta"] = arrays["beta"].at[0, 33, 1].set(jnp.nan)
    ours, want = triton_kda(C16)(**arrays), reference(**arrays)
    assert jnp.array_equal(jnp.isnan(ours), jnp.isnan(want))
    assert_close(ours, want, name="out")


def test_packed_sequences_with_empty_and_length_one_sequences(interpret) -> None:
    # sequences of 1, 0, 22, 13 and 1 tokens; tokens 37.. belong to none (zero output)
    arrays = inputs(1, 40, 2, 16, 32, vector=False)
    cu = jnp.array([0, 1, 1, 23, 36, 37], jnp.int32)
    arrays["initial_state"] = normal(jax.random.PRNGKey(4), (5, 2, 16, 32), jnp.float32)
    check(arrays, C16, grads=True, cu_seqlens=cu, return_state=True)
    out = triton_kda(C16)(**arrays, cu_seqlens=cu)
    assert not jnp.any(out[:, 37:])


def test_two_halves_with_the_carried_state_equal_one_run(interpret) -> None:
    a = inputs(2, 37, 2, 16, 16)
    ours = triton_kda(C16)
    whole, final = ours(**a, return_state=True)
    head = {n: x[:, :19] for n, x in a.items()}
    tail = {n: x[:, 19:] for n, x in a.items()}
    first, mid = ours(**head, return_state=True)
    second, end = ours(**tail, initial_state=mid, return_state=True)
    assert_close(jnp.concatenate([first, second], axis=1), whole, name="out")
    assert_close(end, final, name="final")


# -- the fused recurrent kernel (decoding) ---------------------------------------------------


@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2", "no-l2"])
def test_fused_decoding_with_a_carried_state_matches_the_reference(interpret, vector, l2norm):
    """A few tokens (odd K, two value blocks), from a carried state, both gate forms."""
    arrays = inputs(3, 5, 2, 20, 32, vector=vector)
    arrays["initial_state"] = normal(jax.random.PRNGKey(8), (3, 2, 20, 32), jnp.float32)
    check(arrays, FUSED, use_qk_l2norm=l2norm, softmax_scale=0.3, return_state=True)


def test_fused_packed_sequences_resets_and_non_finite_inputs(interpret) -> None:
    """Packed sequences of 2, 0, 1 and 4 tokens (tokens past the last in none), a −inf gate
    entry, and NaN in a query, a key and a value: each stays in its causal future."""
    arrays = inputs(1, 9, 2, 16, 16)
    cu = jnp.array([0, 2, 2, 3, 7], jnp.int32)
    arrays["initial_state"] = normal(jax.random.PRNGKey(4), (4, 2, 16, 16), jnp.float32)
    arrays["g"] = arrays["g"].at[0, 4, 0, :5].set(-jnp.inf)
    arrays["query"] = arrays["query"].at[0, 0, 1, 3].set(jnp.nan)
    arrays["key"] = arrays["key"].at[0, 5, 0, 2].set(jnp.nan)
    arrays["value"] = arrays["value"].at[0, 1, 1, 7].set(jnp.nan)
    ours, final = triton_kda(FUSED)(**arrays, cu_seqlens=cu, return_state=True)
    want, state = reference(**arrays, cu_seqlens=cu, return_state=True)
    for got, exp, name in ((ours, want, "out"), (final, state, "final")):
        assert jnp.array_equal(jnp.isnan(got), jnp.isnan(exp)), name
        assert_close(got, exp, name=name)
    assert not jnp.any(ours[:, 7:])


def test_decoding_calls_take_the_fused_kernel_and_a_gradient_the_chunked_ones(interpret):
    """The heuristic picks the fused kernel for a few tokens; differentiating such a call runs
    the chunked forward and backward, and the gradients match the reference's."""
    arrays = inputs(2, 3, 2, 16, 16)
    inv = types.SimpleNamespace(kwargs=arrays)
    assert heuristic(inv).fused
    assert not heuristic(types.SimpleNamespace(kwargs=inputs(1, 17, 2, 16, 16))).fused
    check(arrays, None, grads=True, return_state=True)


@pytest.mark.parametrize(
    ("cfg", "vector", "l2norm"),
    [(C16, True, True), (C32, True, False), (C16, False, False), (C32, False, True)],
    ids=["C16-channel-gate", "C32-channel-gate-no-l2", "C16-head-gate-no-l2", "C32-head-gate"],
)
def test_gradients_of_every_input_match_the_reference(interpret, cfg, vector, l2norm) -> None:
    """The backward kernels (two V blocks at C16): query, key, value, beta, g and the initial
    state, under cotangents of the output and of the final state."""
    arrays = inputs(2, 37, 2, 16, 32, vector=vector)
    arrays["initial_state"] = normal(jax.random.PRNGKey(3), (2, 2, 16, 32), jnp.float32)
    if not l2norm:
        arrays["query"], arrays["key"] = arrays["query"] * 0.3, arrays["key"] * 0.3
    check(arrays, cfg, grads=True, use_qk_l2norm=l2norm, softmax_scale=0.3, return_state=True)


def test_gradients_over_several_blocks_of_key_channels(interpret) -> None:
    """Key dim 80 (value dim 48): a per-channel gate's products backward takes three blocks of
    32 key channels, the last one half masked; every gradient, the initial state's too."""
    arrays = inputs(1, 21, 1, 80, 48)
    arrays["initial_state"] = normal(jax.random.PRNGKey(3), (1, 1, 80, 48), jnp.float32)
    check(arrays, C16, grads=True, return_state=True)


def test_gradients_under_vmap_equal_one_call_per_index(interpret) -> None:
    a = inputs(2, 21, 2, 16, 16)
    ours = triton_kda(C16)

    def loss(q, k, v, beta, g):
        out = ours(query=q[None], key=k[None], value=v[None], beta=beta[None], g=g[None])
        return jnp.sum(out * jnp.cos(jnp.arange(16) * 0.7))

    args = tuple(a[n] for n in ("query", "key", "value", "beta", "g"))
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    mapped = jax.vmap(grad)(*args)
    for i in range(2):
        one = grad(*(x[i] for x in args))
        for name, m, o in zip(("dq", "dk", "dv", "dbeta", "dg"), mapped, one, strict=True):
            assert_close(m[i], o, name=name)


def test_registered_at_the_plugins_priority_above_the_xla_fallback() -> None:
    from ejkernel_triton import plugin

    assert "kernel_delta_attention" in plugin.OPS
    assert "kernel_delta_attention" not in plugin.OPT_IN


def test_supports_declines_what_the_kernels_do_not_hold() -> None:
    def call(dk: int, dtype: Any = jnp.float32, vdtype: Any = None) -> Any:
        q = jax.ShapeDtypeStruct((1, 8, 1, dk), dtype)
        v = jax.ShapeDtypeStruct((1, 8, 1, 16), vdtype or dtype)
        beta = jax.ShapeDtypeStruct((1, 8, 1), dtype)
        return types.SimpleNamespace(
            kwargs={"query": q, "key": q, "value": v, "beta": beta, "g": beta}
        )

    assert supports(call(128)) is True
    assert "256" in supports(call(512))
    assert "differ" in supports(call(16, jnp.float32, jnp.bfloat16))
    assert "dtype" in supports(call(16, jnp.float64))


def test_config_checks_its_fields_and_the_space_starts_with_the_heuristic(monkeypatch) -> None:
    fields = ("chunk_size", "block_v")
    inv = check_config_and_gpu_space(
        monkeypatch, KernelDeltaAttentionConfig, fields, config_space, heuristic, "g"
    )
    assert heuristic(inv).chunk_size == 64  # the backward's walk: T / 64 steps
    # 2-stage walks in 4 warps; a differentiated call's whole-chunk passes in 8
    grad = types.SimpleNamespace(**vars(inv), grad=True)
    alone, differentiated = heuristic(inv), heuristic(grad)
    assert (alone.num_warps, alone.num_stages, alone.chunk_warps) == (4, 2, None)
    assert (differentiated.num_warps, differentiated.num_stages) == (4, 2)
    assert differentiated.chunk_warps == 8
    # the spaces have the other choice
    assert attrs.evolve(alone, chunk_warps=8) in config_space(inv)
    assert attrs.evolve(differentiated, chunk_warps=None) in config_space(grad)
    # bf16 products for a 16-bit forward alone, either gate; the space has the other choice
    assert alone.narrow_products and not differentiated.narrow_products
    assert attrs.evolve(alone, narrow_products=False) in config_space(inv)
    scalar = jax.ShapeDtypeStruct((2, 8192, 16), jnp.bfloat16)
    head_gate = types.SimpleNamespace(kwargs={**inv.kwargs, "g": scalar})
    assert heuristic(head_gate).narrow_products
    assert not heuristic(types.SimpleNamespace(**vars(head_gate), grad=True)).narrow_products
    float32 = {n: jax.ShapeDtypeStruct(x.shape, jnp.float32) for n, x in inv.kwargs.items()}
    assert not heuristic(types.SimpleNamespace(kwargs=float32)).narrow_products
    # 16-bit saved states for a differentiated 16-bit call alone; the space has the other
    assert differentiated.narrow_states and not alone.narrow_states
    assert attrs.evolve(differentiated, narrow_states=False) in config_space(grad)
    float32_grad = types.SimpleNamespace(kwargs=float32, grad=True)
    assert not heuristic(float32_grad).narrow_states


@pytest.mark.parametrize("limit", [232448, 101376], ids=["hopper", "sm86"])
def test_configs_over_the_shared_memory_are_left_out_before_compiling(monkeypatch, limit) -> None:
    """K = V = 256 leave no room for chunks of 64 on a Hopper; an Ampere/Ada GPU's 99 KiB
    takes less still; short packed sequences get short chunks."""
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setattr(kda_op._smem, "launch_limit", lambda: limit)
    for d in (128, 256):
        q = jax.ShapeDtypeStruct((2, 8192, 16, d), jnp.bfloat16)
        inv = types.SimpleNamespace(kwargs={"query": q, "key": q, "value": q})
        space = config_space(inv)
        assert all(kda_op.shared_memory(cfg, d, d) <= limit for cfg in space)
        assert len(space) > 1 and space[0] == heuristic(inv)
    assert 64 not in {cfg.chunk_size for cfg in space}  # d = 256
    cu = jax.ShapeDtypeStruct((301,), jnp.int32)
    q = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
    inv = types.SimpleNamespace(kwargs={"query": q, "key": q, "value": q, "cu_seqlens": cu})
    assert heuristic(inv).chunk_size == 16  # 27 tokens a sequence


def test_kernels_compile_for_hopper_with_matrix_instructions(monkeypatch, tmp_path) -> None:
    """The heuristic's launches, forward and backward (bf16, K = V = 128, per-channel gates),
    compiled for sm_90 on any machine."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import kernel_delta_attention as kda

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    call = inputs(1, 64, 2, 128, 128, dtype=jnp.bfloat16)
    cfg = heuristic(types.SimpleNamespace(kwargs=call, grad=True))
    jax.clear_caches()  # the forward is jitted: trace it under the recorder
    with _codegen.recorded_launches() as record:
        out, res = kda._kda_fwd(cfg=cfg, **call)
        kda._kda_bwd(res, out, cfg=cfg)
    names = [launch.kernel.fn.__name__ for launch in record]
    assert names == [
        "kda_fwd_norm_kernel",
        "kda_fwd_intra_kernel",
        "kda_fwd_wy_kernel",
        "kda_fwd_h_kernel",
        "kda_fwd_o_kernel",
        "kda_bwd_dvl_kernel",
        "kda_bwd_dh_kernel",
        "kda_bwd_dv_kernel",
        "kda_bwd_chunk_in_kernel",
        "kda_bwd_products_kernel",
        "kda_bwd_chunk_out_kernel",
    ]
    # the whole-chunk passes in the config's chunk_warps, the walks and outputs in num_warps
    warps = {launch.kernel.fn.__name__: launch.num_warps for launch in record}
    assert (cfg.num_warps, cfg.chunk_warps) == (4, 8)
    wide = ("fwd_norm", "fwd_wy", "bwd_dv", "bwd_chunk_in", "bwd_chunk_out")
    assert {warps[f"kda_{n}_kernel"] for n in wide} == {8}
    assert {warps[f"kda_{n}_kernel"] for n in ("fwd_h", "fwd_o", "bwd_dvl", "bwd_dh")} == {4}
    decode = inputs(4, 1, 2, 128, 128, dtype=jnp.bfloat16)
    fused = heuristic(types.SimpleNamespace(kwargs=decode))
    assert fused.fused and fused.block_v == 64
    longer = inputs(4, kda.FUSED_GPU_MAX_TOKENS + 1, 2, 128, 128, dtype=jnp.bfloat16)
    assert not heuristic(types.SimpleNamespace(kwargs=longer)).fused
    with _codegen.recorded_launches() as decoding:
        kda.kernel_delta_attention_triton(cfg=fused, **decode)
    (launch,) = decoding
    assert launch.kernel.fn.__name__ == "kda_fused_fwd_kernel"
    assert _codegen.compile_launch(launch, capability=90).shared <= 232448
    for launch in record:
        compiled = _codegen.compile_launch(launch, capability=90)
        mix = _codegen.instruction_mix(compiled.ptx)
        name = launch.kernel.fn.__name__
        # elementwise, and a float32 cumulative sum
        if name not in ("kda_fwd_norm_kernel", "kda_bwd_chunk_out_kernel"):
            assert any(k.startswith(("wgmma", "mma")) for k in mix), name
        assert compiled.shared <= kda.shared_memory(cfg, 128, 128) <= 232448, name


def test_the_walks_pipeline_their_loads_with_two_stages(monkeypatch, tmp_path) -> None:
    """The space's 2-stage configs: the sequential walks, forward and backward, bring their
    tiles by 16-byte async copies, within :func:`shared_memory`'s bound."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import kernel_delta_attention as kda

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    q = jax.ShapeDtypeStruct((2, 8192, 16, 128), jnp.bfloat16)
    space = config_space(types.SimpleNamespace(kwargs={"query": q, "key": q, "value": q}))
    piped = [cfg for cfg in space if cfg.num_stages == 2]
    assert piped and all(cfg.chunk_size == space[0].chunk_size for cfg in piped)
    cfg = attrs.evolve(space[0], num_stages=2)
    assert cfg in piped
    call = inputs(1, 128, 2, 128, 128, dtype=jnp.bfloat16)
    jax.clear_caches()
    with _codegen.recorded_launches() as record:
        out, res = kda._kda_fwd(cfg=cfg, **call)
        kda._kda_bwd(res, out, cfg=cfg)
    walks = [launch for launch in record if launch.num_stages == 2]
    assert [launch.kernel.fn.__name__ for launch in walks] == [
        "kda_fwd_h_kernel",
        "kda_bwd_dh_kernel",
    ]
    for launch in walks:
        compiled = _codegen.compile_launch(launch, capability=90)
        assert _codegen.instruction_mix(compiled.ptx).get("cp.async.cg.shared.global", 0) > 0
        assert compiled.shared <= kda.shared_memory(cfg, 128, 128) <= 232448


@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_narrow_products_run_on_bf16_matrix_instructions(monkeypatch, tmp_path, vector) -> None:
    """``narrow_products`` (bf16): the chunk pass's and the outputs' products on bf16
    operands; only the inverse's stay in tf32 (a per-channel gate's normalised q and k are
    written in bf16 too)."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import kernel_delta_attention as kda

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    call = inputs(1, 128, 2, 128, 128, vector=vector, dtype=jnp.bfloat16)
    base = heuristic(types.SimpleNamespace(kwargs=call))

    def compiled(narrow: bool) -> dict[str, Any]:
        """The forward's launches by kernel name: (launch, PTX instruction mix)."""
        jax.clear_caches()
        cfg = attrs.evolve(base, narrow_products=narrow)
        with _codegen.recorded_launches() as record:
            kda.kernel_delta_attention_triton(cfg=cfg, **call)
        return {
            one.kernel.fn.__name__: (
                one,
                _codegen.instruction_mix(_codegen.compile_launch(one, capability=90).ptx),
            )
            for one in record
        }

    narrow, wide = compiled(True), compiled(False)
    count = lambda got, name, kind: sum(n for op, n in got[name][1].items() if kind in op)
    chunk = "kda_fwd_wy_kernel" if vector else "kda_fwd_prep_kernel"
    assert count(narrow, chunk, "bf16") > 0 and count(narrow, "kda_fwd_o_kernel", "bf16") > 0
    assert count(narrow, "kda_fwd_o_kernel", "tf32") == 0
    # the inverse alone (its doublings and substitution) stays in tf32
    assert 0 < count(narrow, chunk, "tf32") < count(wide, chunk, "tf32")
    if vector:
        assert count(narrow, "kda_fwd_intra_kernel", "tf32") == 0
        assert narrow["kda_fwd_norm_kernel"][0].out_shape[0].dtype == jnp.bfloat16


# -- GPU, realistic shapes ------------------------------------------------------------------


def _bf16_inputs(*sizes: int, vector: bool = True) -> dict[str, jax.Array]:
    """:func:`inputs` of ``sizes`` in bfloat16, the gates in float32 and a sixteenth as strong."""
    arrays = inputs(*sizes, vector=vector, dtype=jnp.bfloat16)
    arrays["g"] = arrays["g"].astype(jnp.float32) / 16
    return arrays


def _against_xla(
    arrays: dict[str, jax.Array], grads: bool, cfg: Any = None, **statics: Any
) -> None:
    def run(fn: Any, a: dict[str, jax.Array]) -> Any:
        def loss(a: dict[str, jax.Array]) -> Any:
            out = fn(**a, **statics)
            o = out[0] if statics.get("return_state") else out
            return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.shape[-1]) * 0.7)), out

        if not grads:
            return fn(**a, **statics), {}
        (_, out), g = jax.value_and_grad(loss, has_aux=True)(a)
        return out, g

    out, got = jax.jit(lambda a: run(triton_kda(cfg), a))(arrays)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), arrays)
    xla = lambda **kw: ejkernel.kernel_delta_attention(**kw, platform="xla")
    with jax.default_matmul_precision("highest"):
        want, exp = jax.jit(lambda a: run(xla, a))(up)
    pairs = [*zip(("out", "final"), jax.tree.leaves(out), jax.tree.leaves(want))]
    for name, a, e in pairs + [(f"d{n}", got[n], exp[n]) for n in got]:
        assert bool(jnp.isfinite(jnp.asarray(a, jnp.float32)).all()), name
        assert rel(a, e) < 2e-2, (name, rel(a, e))


@pytest.mark.gpu
@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_gpu_bf16_forward_matches_the_xla_path(vector: bool) -> None:
    b, _, h, dk, dv = GPU_SHAPE
    arrays = _bf16_inputs(*GPU_SHAPE, vector=vector)
    arrays["initial_state"] = normal(jax.random.PRNGKey(2), (b, h, dk, dv), jnp.float32)
    _against_xla(arrays, grads=False, return_state=True)


@pytest.mark.gpu
@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_gpu_bf16_gradients_match_the_xla_path(vector: bool) -> None:
    _against_xla(_bf16_inputs(*GPU_SHAPE, vector=vector), grads=True)


@pytest.mark.gpu
@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_gpu_narrow_products_match_the_xla_path(vector: bool) -> None:
    """The config space's ``narrow_products`` (the forward's products on bf16 operands)."""
    arrays = _bf16_inputs(*GPU_SHAPE, vector=vector)
    call = {k: arrays[k] for k in ("query", "key", "value")}
    cfg = attrs.evolve(heuristic(types.SimpleNamespace(kwargs=call)), narrow_products=True)
    _against_xla(arrays, grads=True, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("vector", [True, False], ids=["channel-gate", "head-gate"])
def test_gpu_two_stage_walks_match_the_xla_path(vector: bool) -> None:
    """The config space's pipelined walks (2 stages), forward and gradients."""
    arrays = _bf16_inputs(*GPU_SHAPE, vector=vector)
    call = {k: arrays[k] for k in ("query", "key", "value")}
    cfg = attrs.evolve(heuristic(types.SimpleNamespace(kwargs=call)), num_stages=2)
    _against_xla(arrays, grads=True, cfg=cfg)


@pytest.mark.gpu
def test_gpu_packed_sequences_match_the_xla_path() -> None:
    arrays = _bf16_inputs(1, 8192, 16, 128, 128)
    cu = jnp.array([0, 1, 1, 1000, 4097, 8000, 8192], jnp.int32)
    _against_xla(arrays, grads=False, cu_seqlens=cu, return_state=True)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_vmap_equals_one_call_per_index(interpret, packed: bool) -> None:
    a = inputs(2, 21, 2, 16, 16, vector=False)
    cu = jnp.array([0, 9, 21], jnp.int32) if packed else None
    ours = triton_kda(C16)

    def f(q, k, v, beta, g):
        out = ours(
            query=q[None], key=k[None], value=v[None], beta=beta[None], g=g[None], cu_seqlens=cu
        )
        return out[0]

    args = tuple(a[n] for n in ("query", "key", "value", "beta", "g"))
    mapped = jax.vmap(f)(*args)
    for i in range(2):
        assert_close(mapped[i], f(*(x[i] for x in args)), name="out")
