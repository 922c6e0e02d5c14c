"""Ring attention on flash-attention steps: the (out, lse) contract, the zigzag layout, and
``Executor(method="shard_map")``; the multi-device cases run in a subprocess on 2 and 4 host
devices (``_ring_attention_flash_devices.py``)."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tests.xla._host_devices import run_on_host_devices

import ejkernel
from ejkernel.modules import FlashAttention
from ejkernel.ops import Executor, flash_attention_lse_step, undo_zigzag_layout, zigzag_layout
from ejkernel.plugins import get_registry
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close, random_normal

HELPER = pathlib.Path(__file__).with_name("_ring_attention_flash_devices.py")


def inputs(b: int = 2, sq: int = 37, sk: int = 45, hq: int = 4, hkv: int = 2, d: int = 16) -> Any:
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    return (
        random_normal(kq, (b, sq, hq, d)),
        random_normal(kk, (b, sk, hkv, d)),
        random_normal(kv, (b, sk, hkv, d)),
    )


@pytest.mark.parametrize("devices", [2, 4], ids=["2-devices", "4-devices"])
def test_ring_on_flash_steps_matches_flash_attention_on_the_global_arrays(devices: int) -> None:
    stdout = run_on_host_devices(HELPER, devices)
    assert stdout.count("ok ") == (5 if devices == 2 else 2), stdout


# -- the zigzag layout --------------------------------------------------------------------------


def test_zigzag_layout_gives_device_r_chunks_r_and_2n_minus_1_minus_r_and_undoes() -> None:
    n, chunk = 4, 3
    x = jnp.arange(2 * n * chunk)[None, :, None]
    laid = zigzag_layout(x, n)
    shards = np.asarray(laid[0, :, 0]).reshape(n, 2, chunk) // chunk
    for r in range(n):
        assert list(shards[r, :, 0]) == [r, 2 * n - 1 - r]
    np.testing.assert_array_equal(np.asarray(undo_zigzag_layout(laid, n)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(undo_zigzag_layout(zigzag_layout(x, 1), 1)), x)


def test_zigzag_layout_needs_a_length_divisible_by_2n() -> None:
    with pytest.raises(ValueError, match=r"^ring_attention: the zigzag layout cuts axis 1 into 6"):
        zigzag_layout(jnp.ones((1, 10, 2)), 3)


# -- the (out, lse) contract ---------------------------------------------------------------------


def reference_lse(q: Any, k: Any, *, causal: bool) -> Any:
    """Log-sum-exp of the scaled logits [B, Sq, Hq], bottom-right causal."""
    group = q.shape[2] // k.shape[2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = jnp.arange(sq)[:, None] + (sk - sq) >= jnp.arange(sk)[None, :]
        logits = jnp.where(visible, logits, -jnp.inf)
    return jax.nn.logsumexp(logits, axis=-1).transpose(0, 2, 1)


def test_the_xla_step_returns_out_and_lse_and_gradients_from_given_statistics() -> None:
    q, k, v = inputs(sq=13, sk=21, d=8)
    step = flash_attention_lse_step(query=q, key=k, value=v, causal=True)
    assert step.platform == "xla"
    out, lse = step.forward(query=q, key=k, value=v, causal=True)
    assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    assert_close(out, flash_attention_reference(q, k, v, causal=True), name="out")
    assert_close(lse, reference_lse(q, k, causal=True), name="lse")
    d_out = random_normal(jax.random.PRNGKey(5), out.shape)
    grads = step.backward(out, lse, d_out, query=q, key=k, value=v, causal=True)
    _, vjp = jax.vjp(lambda *a: flash_attention_reference(*a, causal=True), q, k, v)
    for name, expected in zip(("query", "key", "value"), vjp(d_out)):
        assert_close(grads[name], expected, name=f"d{name}")


def test_a_selected_platform_without_the_contract_gives_way_to_the_xla_step() -> None:
    registry = get_registry()
    registry.add_platform("nolse")
    registry.register("flash_attention", platform="nolse", backend="any", priority=10**6)(
        lambda **args: ejkernel.flash_attention(**{k: v for k, v in args.items() if k != "cfg"})
    )
    q, k, v = inputs()
    assert ejkernel.explain("flash_attention", q, k, v).platform == "nolse"
    assert flash_attention_lse_step(query=q, key=k, value=v).platform == "xla"


# -- ring calls declined or refused -------------------------------------------------------------


def one_device_ring(**options: Any) -> Any:
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))

    def inner(q: Any, k: Any, v: Any) -> Any:
        return ejkernel.ring_attention(q, k, v, axis_name="sp", **options)

    return jax.shard_map(inner, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))


@pytest.mark.parametrize(
    ("name", "value"), [("sliding_window", 4), ("dropout_prob", 0.1)], ids=["window", "dropout"]
)
def test_zigzag_with_a_window_or_dropout_is_refused_before_any_kernel(
    name: str, value: Any
) -> None:
    q, k, v = inputs(sq=36, sk=36)
    with pytest.raises(ValueError, match=rf"layout`='zigzag' takes no `{name}`"):
        one_device_ring(layout="zigzag", causal=True, **{name: value})(q, k, v)


@pytest.mark.parametrize(
    ("shapes", "options", "match"),
    [
        ({"sq": 37, "sk": 37}, {}, r"needs query and key shards of one even length"),
        ({"sq": 36, "sk": 36}, {"bias": jnp.ones((1, 1, 1, 36))}, r"takes no `bias`"),
        ({"sq": 36, "sk": 36}, {"layout": "striped"}, r"`layout` must be one of"),
    ],
    ids=["odd-length", "bias", "unknown-layout"],
)
def test_bad_zigzag_calls_raise_before_any_kernel(
    shapes: dict[str, int], options: dict[str, Any], match: str
) -> None:
    options = {"layout": "zigzag", **options}
    with pytest.raises(ValueError, match=f"^ring_attention: .*{match}"):
        one_device_ring(**options)(*inputs(**shapes))


# -- Executor(method="shard_map") -------------------------------------------------------------


def test_executor_shard_map_method_needs_a_known_method_and_out_specs() -> None:
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"`method` must be 'shard_map'"):
        Executor()(FlashAttention(), q, k, v, method="pmap", out_specs=P())
    with pytest.raises(TypeError, match=r"needs `out_specs`"):
        Executor()(FlashAttention(), q, k, v, method="shard_map", in_specs=P())
