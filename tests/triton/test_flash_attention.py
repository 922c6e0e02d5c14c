"""The Triton flash attention through Triton's interpreter on the CPU, against the reference.

The same kernel source runs on the GPU through jax-triton (``test_flash_attention_gpu.py``).
Shapes are small (the interpreter runs each program in Python) but odd: sequences 37 and 45,
Sq != Sk both ways, head dims 80 and 32, Dv != D, GQA and MQA, several blocks per axis.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.flash_attention import FlashAttentionConfig

#: 16-row blocks: several blocks per axis at these lengths, with cut tails.
SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=16, num_warps=4, num_stages=1),
    bwd_params=BwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=1),
)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def qkv(
    b: int,
    sq: int,
    sk: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(sq * 7 + sk + d), 3)
    return (
        normal(ks[0], (b, sq, hq, d), dtype),
        normal(ks[1], (b, sk, hkv, d), dtype),
        normal(ks[2], (b, sk, hkv, dv or d), dtype),
    )


def compare(q: Any, k: Any, v: Any, cfg: Any = SMALL, grads: bool = True, **kwargs: Any) -> Any:
    """Output (and gradients of every array input) of the Triton op vs the reference."""
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
    statics = {n: x for n, x in kwargs.items() if n not in arrays}
    diff = {n: x for n, x in arrays.items() if jnp.issubdtype(x.dtype, jnp.floating)}
    rest = {n: x for n, x in arrays.items() if n not in diff}

    def ours(q, k, v, diff):
        return ejkernel.flash_attention(
            q, k, v, **diff, **rest, **statics, platform="triton", cfg=cfg
        )

    def ref(q, k, v, diff):
        return flash_attention_reference(q, k, v, **diff, **rest, **statics)

    out = ours(q, k, v, diff)
    want = ref(q, k, v, diff)
    assert out.dtype == q.dtype and out.shape == want.shape
    assert_close(out, want, name="out")
    if grads:
        d_out = normal(jax.random.PRNGKey(3), out.shape, out.dtype)
        got = jax.vjp(ours, q, k, v, diff)[1](d_out)
        exp = jax.vjp(ref, q, k, v, diff)[1](d_out)
        for name, g, e in zip(("dq", "dk", "dv", "d"), got, exp):
            for leaf_g, leaf_e in zip(jax.tree.leaves(g), jax.tree.leaves(e)):
                assert leaf_g.shape == leaf_e.shape and leaf_g.dtype == leaf_e.dtype
                assert_close(leaf_g, leaf_e, name=name)
    return out


@pytest.mark.parametrize(
    "shape",
    [(2, 37, 37, 4, 4, 80, None), (1, 37, 45, 4, 2, 32, None), (1, 45, 37, 3, 1, 80, 48)],
    ids=["square-d80", "gqa-sq<sk-d32", "mqa-sq>sk-dv48"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_output_and_gradients_match_the_reference(shape: tuple, causal: bool) -> None:
    compare(*qkv(*shape), causal=causal)


def test_sliding_window_and_soft_cap() -> None:
    q, k, v = qkv(1, 37, 45, 4, 2, 32)
    compare(q, k, v, sliding_window=(9, 4), logits_soft_cap=2.5)
    compare(q, k, v, sliding_window=(5, 0), causal=True)


@pytest.mark.parametrize(("scale", "spread"), [(0.3, 1.0), (-0.2, 30.0)], ids=["pos", "neg"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale_of_either_sign_on_whole_and_cut_blocks(
    scale: float, spread: float, causal: bool
) -> None:
    # 16-key blocks over 45 keys: whole blocks, where a scale >= 0 rides in the exponent, and
    # a cut one. Negative: logits spread over hundreds, so that a row maximum taken from the
    # wrong end (the raw scores' maximum) would overflow exp2.
    q, k, v = qkv(1, 37, 45, 2, 2, 32)
    compare(q * spread, k, v, causal=causal, softmax_scale=scale)


def test_the_scale_rides_in_the_exponent_only_where_nothing_is_masked_or_added() -> None:
    from ejkernel_triton import _codegen

    def plain_scale(**kwargs: Any) -> bool:
        (fwd, *_) = _codegen.flash_attention_launches((1, 64, 2, 64), causal=False, **kwargs)
        return fwd.constexprs["PLAIN_SCALE"]

    assert plain_scale()
    assert not plain_scale(softmax_scale=-0.5)
    assert not plain_scale(logits_soft_cap=3.0)
    assert not plain_scale(bias=jnp.ones((1, 2, 64, 64)))
    assert not plain_scale(attention_mask=jnp.ones((1, 1, 64, 64), bool))
    seg = jnp.zeros((1, 64), jnp.int32)
    assert not plain_scale(q_segment_ids=seg, kv_segment_ids=seg)


@pytest.mark.parametrize("bias_shape", [(1, 4, 37, 45), (2, 1, 1, 45), (37, 45)], ids=str)
def test_bias_and_its_gradient_in_the_bias_shape(bias_shape: tuple[int, ...]) -> None:
    q, k, v = qkv(2, 37, 45, 4, 2, 32)
    bias = normal(jax.random.PRNGKey(5), bias_shape)
    compare(q, k, v, bias=bias, causal=True)


def test_attention_mask_and_segment_ids() -> None:
    q, k, v = qkv(2, 37, 37, 4, 2, 32)
    mask = jax.random.bernoulli(jax.random.PRNGKey(6), 0.7, (2, 1, 37, 37))
    seg = np.zeros((2, 37), np.int32)
    seg[:, 20:] = 1
    seg[1, 30:] = -1  # padding: rows without keys
    seg = jnp.asarray(seg)
    out = compare(q, k, v, attention_mask=mask, q_segment_ids=seg, kv_segment_ids=seg)
    assert float(jnp.abs(out[1, 30:]).max()) == 0.0


@pytest.mark.parametrize("aux_shape", [(4,), (4, 3)], ids=["per-head", "three-per-head"])
def test_sinks_and_their_gradient(aux_shape: tuple[int, ...]) -> None:
    q, k, v = qkv(1, 37, 45, 4, 2, 32)
    compare(q, k, v, softmax_aux=normal(jax.random.PRNGKey(7), aux_shape), causal=True)


def test_rows_that_see_no_key_are_zero_with_zero_gradients() -> None:
    q, k, v = qkv(1, 45, 20, 2, 2, 32)  # causal, Sq > Sk: the first 25 rows see nothing
    out = compare(q, k, v, causal=True)
    assert float(jnp.abs(out[:, :25]).max()) == 0.0


def test_causal_forward_walks_heads_in_groups_longest_blocks_first() -> None:
    # 3 x 7 = 21 (batch, head) pairs: a group of 16 and a cut group of 5
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import flash_attention as fa

    q, k, v = qkv(3, 37, 45, 7, 7, 32)
    compare(q, k, v, causal=True)
    with _codegen.recorded_launches() as rec:
        fa._flash_attention_fwd(query=q, key=k, value=v, causal=True, cfg=SMALL)
    assert rec[0].constexprs["HEAD_GROUP"] == fa._FWD_HEAD_GROUP == 16


def test_heuristic_by_head_dim_and_causality(monkeypatch: pytest.MonkeyPatch) -> None:
    from ejkernel_triton.ops import flash_attention as fa

    monkeypatch.setattr(fa._launch, "interpreting", lambda: False)
    monkeypatch.setattr(fa, "_compute_capability", lambda: (9, 0))

    def config(d: int, causal: bool, **extra: Any) -> Any:
        x = jax.ShapeDtypeStruct((8, 2048, 16, d), jnp.bfloat16)
        kwargs = {"query": x, "key": x, "value": x, "causal": causal, **extra}
        return fa.heuristic(types.SimpleNamespace(kwargs=kwargs))

    # the D 64 forward: 128 rows with 8 warps where plain and not causal, else 64 with 4
    assert config(64, False).fwd_params == fa._FWD_D64_PLAIN
    assert config(64, True).fwd_params == fa._FWD_D128
    assert config(64, False, logits_soft_cap=5.0).fwd_params == fa._FWD_D128
    assert config(64, False, softmax_scale=-0.1).fwd_params == fa._FWD_D128
    seg = jax.ShapeDtypeStruct((8, 2048), jnp.int32)
    assert config(64, False, q_segment_ids=seg, kv_segment_ids=seg).fwd_params == fa._FWD_D128
    assert config(32, False).fwd_params == fa._FWD_D128
    assert config(64, True).bwd_params == fa._BWD_D64_CAUSAL
    assert config(64, False).bwd_params == fa._BWD_D64
    assert config(64, True).dq_params == config(64, False).dq_params == fa._DQ_D64
    assert config(128, True).warp_specialize  # plain D 128: the specialized kernels
    bias = jax.ShapeDtypeStruct((8, 16, 2048, 2048), jnp.bfloat16)
    assert config(128, True, bias=bias).bwd_params == fa._BWD_D128_CAUSAL
    assert config(128, False, bias=bias).bwd_params == fa._BWD_D128


def test_bf16_inputs_within_bf16_tolerance() -> None:
    q, k, v = qkv(1, 37, 45, 4, 2, 80, dtype=jnp.bfloat16)
    compare(q, k, v, causal=True)


#: The warp-specialized forward and dK/dV kernels (Hopper's TMA kernels; the interpreter runs
#: their math): 16-key blocks in the dK/dV kernel, so its loop crosses query blocks and heads.
WS = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=32, kv_blocksize=16, num_warps=4, num_stages=2),
    bwd_params=SMALL.bwd_params,
    warp_specialize=True,
)


@pytest.fixture
def forward_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels launched, in order (the launches still run)."""
    from ejkernel_triton import _launch

    names: list[str] = []
    real = _launch.launch

    def spy(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(kernel.fn.__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(_launch, "launch", spy)
    return names


@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [
        ((2, 37, 37, 4, 2, 64), {"causal": True}),
        ((1, 50, 70, 2, 1, 128), {"causal": True, "logits_soft_cap": 5.0}),
        ((1, 45, 20, 2, 2, 64), {"causal": True}),  # Sq > Sk: the first 25 rows see nothing
        ((2, 40, 37, 2, 2, 64), {"softmax_scale": 0.3}),  # a cut last key block
        ((1, 37, 50, 4, 2, 64), {"causal": True, "logits_soft_cap": 3.0}),
    ],
    ids=["gqa-s37", "mqa-sq<sk-d128-softcap", "sq>sk-empty-rows", "full-cut-keys", "gqa-softcap"],
)
def test_warp_specialized_kernels_match_the_reference(
    forward_kernels: list[str], shape: tuple, kwargs: dict[str, Any]
) -> None:
    out = compare(*qkv(*shape, dtype=jnp.bfloat16), cfg=WS, **kwargs)
    # the output, then the forward of the VJP and the backward's two kernels
    assert forward_kernels == [
        "flash_attention_fwd_ws_kernel",
        "flash_attention_fwd_ws_kernel",
        "flash_attention_bwd_dkdv_ws_kernel",
        "flash_attention_bwd_dq_ws_kernel",
    ]
    if kwargs.get("causal") and shape[1] > shape[2]:
        assert float(jnp.abs(out[:, :25].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize(
    ("shape", "dtype", "kwargs"),
    [
        ((1, 37, 37, 2, 2, 80), jnp.bfloat16, {}),  # D not 64 or 128
        ((1, 37, 37, 2, 2, 64), jnp.float32, {}),
        ((1, 37, 37, 2, 2, 64), jnp.bfloat16, {"sliding_window": (8, 0)}),
        ((1, 37, 37, 2, 2, 64), jnp.bfloat16, {"softmax_aux": jnp.ones((2,), jnp.float32)}),
    ],
    ids=["d80", "f32", "window", "sinks"],
)
def test_warp_specialization_falls_back_where_it_does_not_apply(
    forward_kernels: list[str], shape: tuple, dtype: Any, kwargs: dict[str, Any]
) -> None:
    compare(*qkv(*shape, dtype=dtype), cfg=WS, grads=False, causal=True, **kwargs)
    assert forward_kernels == ["flash_attention_fwd_kernel"]


def test_default_config_and_scaled_dot_product_attention() -> None:
    q, k, v = qkv(1, 37, 37, 2, 2, 32)
    compare(q, k, v, cfg=None, grads=False, causal=True)
    out = ejkernel.scaled_dot_product_attention(q, k, v, causal=True, platform="triton")
    assert_close(out, flash_attention_reference(q, k, v, causal=True), name="sdpa")


def test_jit_and_vmap_compose_with_the_kernels() -> None:
    q, k, v = qkv(2, 37, 45, 2, 1, 32)  # vmapped over the batch axis of 2

    def f(q, k, v):
        return ejkernel.flash_attention(q, k, v, causal=True, platform="triton", cfg=SMALL)

    def r(q, k, v):
        return flash_attention_reference(q, k, v, causal=True)

    add = lambda x: x[:, None]
    got = jax.jit(jax.vmap(f))(add(q), add(k), add(v))
    assert_close(got, jax.vmap(r)(add(q), add(k), add(v)), name="vmap out")
    # vmap of grad, with k/v shared (unbatched) across the mapped axis
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
    g = jax.vmap(jax.grad(loss(f), argnums=(0, 1, 2)), in_axes=(0, None, None))(
        add(q), k[:1], v[:1]
    )
    e = jax.vmap(jax.grad(loss(r), argnums=(0, 1, 2)), in_axes=(0, None, None))(
        add(q), k[:1], v[:1]
    )
    for name, a, b in zip(("dq", "dk", "dv"), g, e):
        assert_close(a, b, name=f"vmap {name}")


def test_dropout_is_declined_and_served_by_xla() -> None:
    q, k, v = qkv(1, 37, 37, 2, 2, 32)
    record = ejkernel.explain("flash_attention", q, k, v, dropout_prob=0.1)
    assert record.platform != "triton"
    assert "dropout" in record.rejected["triton"]


def test_without_the_interpreter_the_cpu_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    q, k, v = qkv(1, 37, 37, 2, 2, 32)
    record = ejkernel.explain("flash_attention", q, k, v)
    assert record.platform == "xla"
    assert "EJKERNEL_INTERPRET=1" in record.rejected["triton"]


def test_config_space_starts_with_the_heuristic_and_fits_shared_memory() -> None:
    from ejkernel_triton.ops import flash_attention as fa

    shape = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
    inv = types.SimpleNamespace(kwargs={"query": shape, "key": shape, "value": shape})

    # on a GPU: the heuristic first, every candidate within the shared-memory limit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa._launch, "interpreting", lambda: False)
        mp.setattr(fa, "_shared_memory_limit", lambda: 160 * 1024)
        space = fa.config_space(inv)
        assert space[0] == fa.heuristic(inv) and len(space) > 4
        for cfg in space[1:]:
            f, b = cfg.fwd_params, cfg.bwd_params
            assert (
                fa._fwd_smem(f.q_blocksize, f.kv_blocksize, f.num_stages, 128, 128, 2)
                <= (160 * 1024)
                or f == space[0].fwd_params
            )
            assert (
                fa._bwd_smem(b.q_blocksize, b.kv_blocksize, b.num_stages, 128, 128, 2)
                <= (160 * 1024)
                or b == space[0].bwd_params
            )
    assert fa.config_space(inv) == [fa.heuristic(inv)]  # interpreting: one candidate


@pytest.mark.parametrize("gluon", [True, False])
def test_config_space_on_hopper_varies_the_backward_on_the_usual_kernels(gluon: bool) -> None:
    # under warp_specialize a GPU runs the validated configs, so a backward variant of the
    # specialized base would time the same kernels again; with Gluon the plain case's backward
    # is the one Gluon kernel whatever the config, so nothing of the backward varies
    from ejkernel_triton.ops import flash_attention as fa

    shape = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
    inv = types.SimpleNamespace(kwargs={"query": shape, "key": shape, "value": shape})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa._launch, "interpreting", lambda: False)
        mp.setattr(fa, "_compute_capability", lambda: (9, 0))
        mp.setattr(fa, "_gluon_available", lambda: gluon)
        space = fa.config_space(inv)
    assert space[0].warp_specialize  # the heuristic: all three kernels specialized
    specialized = [cfg for cfg in space if cfg.warp_specialize]
    assert specialized == [space[0]]
    dkdv = [cfg for cfg in space if cfg.bwd_params != space[0].bwd_params]
    dq = [cfg for cfg in space if cfg.dq_params]
    assert bool(dkdv) == bool(dq) != gluon
    assert all(cfg.fwd_params == fa._FWD_D128 for cfg in dkdv + dq)


def test_importing_the_plugin_imports_no_triton_or_jax_triton() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ejkernel, ejkernel_triton.plugin, ejkernel_triton.ops.flash_attention\n"
        "assert 'triton' not in sys.modules and 'jax_triton' not in sys.modules, "
        "sorted(m for m in sys.modules if 'triton' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_soft_cap_of_large_logits_stays_finite() -> None:
    # scale·q·kᵀ / cap reaches about ±100: a tanh through exp2(-2x) overflows to inf / inf
    q, k, v = qkv(1, 37, 45, 2, 1, 32)
    compare(q * 60.0, k, v, causal=True, logits_soft_cap=1.0)
