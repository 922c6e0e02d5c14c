"""The XLA ring attention: flash attention without an axis, the ring on 1, 4 and 8 devices.

Every call goes through the public ``ejkernel.ring_attention`` (the executor wires the custom
VJP). The 4- and 8-device rings run in a subprocess (``_ring_attention_devices.py``) because
the host device count must be fixed before JAX starts; in this process a one-device mesh runs
the same ring kernel with a ring of one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tests.xla._host_devices import run_on_host_devices

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import ATTENTION_SHAPES, AttentionShape, assert_close, attention_inputs
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.ring_attention import RingAttentionConfig, config_space, heuristic

SHORT_Q = ATTENTION_SHAPES[2]  # B2-Sq37-Sk129-Hq6-Hkv1-D32
#: Small odd shapes (compile time is what these tests spend).
GQA = AttentionShape(b=1, sq=45, sk=45, hq=8, hkv=2, d=16)
LONG_Q = AttentionShape(b=2, sq=45, sk=29, hq=4, hkv=2, d=16, dv=24)
#: Long enough for several block candidates (shapes only: configs are never run here).
TUNABLE = AttentionShape(b=1, sq=300, sk=1500, hq=4, hkv=2, d=64)
DIFFERENTIABLE = ("query", "key", "value", "bias", "softmax_aux")
SMALL = RingAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=32),
    bwd_params=BwdParams(q_blocksize=32, kv_blocksize=16),
)
HELPER = Path(__file__).with_name("_ring_attention_devices.py")


def fwd_bwd(fn: Any, arrays: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Output of ``fn(**arrays)`` and the gradients of its differentiable arrays, jitted."""
    wrt = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}
    rest = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}

    @jax.jit
    def run(wrt: dict[str, Any], rest: dict[str, Any]) -> tuple[Any, Any]:
        out, vjp = jax.vjp(lambda w: fn(**w, **rest), wrt)
        return out, vjp(normal(jax.random.PRNGKey(42), out.shape, out.dtype))[0]

    return run(wrt, rest)


def check(fn: Any, arrays: dict[str, Any], dtype: Any = jnp.float32, **statics: Any) -> Any:
    """``fn`` (ring attention) against flash attention's reference: output and gradients."""
    out, grads = fwd_bwd(functools.partial(fn, **statics), arrays)
    as_f32 = {n: x.astype(jnp.float32) if x.dtype == dtype else x for n, x in arrays.items()}
    ref_out, ref_grads = fwd_bwd(functools.partial(flash_attention_reference, **statics), as_f32)
    assert out.dtype == arrays["query"].dtype
    assert_close(out, ref_out, dtype=dtype, name="out")
    for name, grad in grads.items():
        assert grad.shape == arrays[name].shape and grad.dtype == arrays[name].dtype
        assert_close(grad, ref_grads[name], dtype=dtype, name=f"d{name}")
    return out, grads


def qkv(shape: AttentionShape, dtype: Any = jnp.float32) -> dict[str, Any]:
    return dict(zip(("query", "key", "value"), attention_inputs(shape, dtype)))


# -- without axis_name: flash attention ---------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        (GQA, {"causal": True, "logits_soft_cap": 2.0, "sliding_window": (20, 3)}),
        (LONG_Q, {"causal": True, "dropout_prob": 0.2, "dropout_seed": 3}),
    ],
    ids=["GQA-causal-softcap-window", "LONG_Q-causal-dropout-bias-sinks"],
)
def test_without_axis_name_it_is_flash_attention(
    shape: AttentionShape, options: dict[str, Any]
) -> None:
    arrays = qkv(shape)
    if "dropout_prob" in options:
        arrays["bias"] = normal(jax.random.PRNGKey(1), (1, shape.hq, 1, shape.sk))
        arrays["softmax_aux"] = normal(jax.random.PRNGKey(2), (shape.hq,))
    ours, _ = check(ejkernel.ring_attention, arrays, **options)
    flash = ejkernel.flash_attention(**arrays, **options)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(flash))


def test_jit_and_vmap_without_axis_name() -> None:
    arrays = qkv(SHORT_Q)
    stacked = {n: jnp.stack([x, 0.5 * x]) for n, x in arrays.items()}
    ours = jax.jit(jax.vmap(lambda a: ejkernel.ring_attention(**a, causal=True)))(stacked)
    ref = jax.vmap(lambda a: flash_attention_reference(**a, causal=True))(stacked)
    assert_close(ours, ref)


# -- on a ring --------------------------------------------------------------------------------


def one_device_ring(cfg: RingAttentionConfig | None = None) -> Any:
    """``ejkernel.ring_attention`` inside ``shard_map`` over a one-device axis ``"sp"``."""
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))

    def call(**kwargs: Any) -> Any:
        arrays = {n: x for n, x in kwargs.items() if hasattr(x, "shape")}
        statics = {n: x for n, x in kwargs.items() if n not in arrays}
        names = tuple(arrays)

        def inner(*xs: Any) -> Any:
            args = dict(zip(names, xs))
            return ejkernel.ring_attention(**args, **statics, axis_name="sp", cfg=cfg)

        specs = tuple(P() if arrays[n].ndim == 0 else P(None, "sp") for n in names)
        return jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=P(None, "sp"))(
            *arrays.values()
        )

    return call


def test_a_ring_of_one_device_runs_the_ring_kernel() -> None:
    shape = SHORT_Q  # Sq=37, Sk=129: padded blocks, bottom-right causal
    arrays = qkv(shape)
    q_seg = np.zeros((shape.b, shape.sq), np.int32)
    q_seg[:, 20:], q_seg[1, 30:] = 1, -1
    kv_seg = np.zeros((shape.b, shape.sk), np.int32)
    kv_seg[:, 100:] = 1
    arrays.update(
        bias=normal(jax.random.PRNGKey(1), (shape.b, 1, shape.sq, shape.sk)),
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
        dropout_seed=jnp.uint32(11),
    )
    statics = {"causal": True, "logits_soft_cap": 4.0, "dropout_prob": 0.1, "softmax_scale": 0.3}
    out, grads = check(one_device_ring(SMALL), arrays, **statics)
    assert np.all(np.asarray(out)[1, 30:] == 0.0) and np.all(
        np.asarray(grads["query"])[1, 30:] == 0.0
    )


def test_a_ring_call_under_the_autotune_policy_keeps_the_heuristic(monkeypatch: Any) -> None:
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    arrays = qkv(LONG_Q)
    ours = one_device_ring()(**arrays, causal=True)
    assert_close(ours, flash_attention_reference(**arrays, causal=True))


def test_a_ring_of_one_device_in_bfloat16() -> None:
    arrays = qkv(LONG_Q, jnp.bfloat16)
    arrays["softmax_aux"] = normal(jax.random.PRNGKey(2), (LONG_Q.hq, 2))
    check(one_device_ring(SMALL), arrays, jnp.bfloat16, sliding_window=(20, 5))


@pytest.mark.parametrize("devices", [4, 8], ids=["4-devices", "8-devices"])
def test_ring_on_host_devices_matches_flash_attention_on_the_global_arrays(devices: int) -> None:
    stdout = run_on_host_devices(HELPER, devices)
    assert stdout.count("ok ") == (2 if devices == 4 else 1), stdout


# -- selection, configs, errors ---------------------------------------------------------------


def test_explain_reports_the_xla_heuristic_and_an_override() -> None:
    arrays = qkv(GQA)
    sel = ejkernel.explain("ring_attention", **arrays, causal=True)
    assert sel.platform == "xla" and sel.source == "heuristic"
    assert isinstance(sel.config, RingAttentionConfig)
    assert ejkernel.explain("ring_attention", **arrays, cfg=SMALL).config == SMALL


class _Invocation:
    def __init__(self, shape: AttentionShape, axis_name: str | None) -> None:
        q = jax.ShapeDtypeStruct((shape.b, shape.sq, shape.hq, shape.d), jnp.float32)
        k = jax.ShapeDtypeStruct((shape.b, shape.sk, shape.hkv, shape.d), jnp.float32)
        self.kwargs = {"query": q, "key": k, "axis_name": axis_name}
        self.metadata = {"grad": True}


@pytest.mark.parametrize("shape", [SHORT_Q, TUNABLE], ids=str)
def test_configs_never_use_blocks_longer_than_the_local_shard(shape: AttentionShape) -> None:
    inv = _Invocation(shape, axis_name=None)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space))
    for cfg in space:
        for params in (cfg.fwd_params, cfg.bwd_params):
            assert 1 <= params.q_blocksize <= shape.sq and 1 <= params.kv_blocksize <= shape.sk


def test_a_ring_call_is_never_autotuned_outside_its_shard_map() -> None:
    # Synthetic timing runs outside the trace that binds the axis: one candidate, no tuning.
    ring = _Invocation(TUNABLE, axis_name="sp")
    assert config_space(ring) == [heuristic(ring)]
    assert len(config_space(_Invocation(TUNABLE, axis_name=None))) > 1


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"axis_name": "sp"}, ValueError, r"`axis_name`='sp' is not a bound mesh axis"),
        ({"axis_name": ["sp"]}, TypeError, r"`axis_name` must be a mesh axis name"),
        ({"key": jnp.ones((2, 129, 4, 32))}, ValueError, r"`key` must be \[B, Sk, Hkv, D\]"),
        (
            {"bias": jnp.ones((1, 1, 37, 258))},
            ValueError,
            r"`bias` must be broadcastable to \[B, Hq, Sq, n·Sk\]",
        ),
        ({"attention_mask": jnp.ones((37, 129))}, TypeError, r"`attention_mask` must be bool"),
        ({"q_segment_ids": jnp.ones((2, 37), jnp.int32)}, ValueError, r"given together"),
        ({"dropout_prob": 1.0}, ValueError, r"`dropout_prob` must be in \[0, 1\)"),
    ],
    ids=[
        "unbound-axis",
        "unhashable-axis",
        "key-heads",
        "bias-columns",
        "float-mask",
        "one-segment",
        "dropout-1",
    ],
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    change: dict[str, Any], error: type, match: str
) -> None:
    args = {**qkv(SHORT_Q), **change}
    with pytest.raises(error, match=f"^ring_attention: .*{match}"):
        ejkernel.ring_attention(**args)


def test_bias_spans_every_key_column_of_the_ring() -> None:
    # Inside a ring of n devices the bias has n·Sk columns; a local-width bias is refused.
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = attention_inputs(SHORT_Q)

    def inner(q: Any, k: Any, v: Any) -> Any:
        return ejkernel.ring_attention(q, k, v, axis_name="sp", bias=jnp.ones((1, 1, 1, 7)))

    call = jax.shard_map(inner, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"^ring_attention: `bias` .*\(2, 6, 37, 129\)"):
        call(q, k, v)
