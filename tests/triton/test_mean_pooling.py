"""The Triton mean pooling against the reference (interpreter on the CPU) and against the XLA
platform at realistic shapes (``gpu``): dense and packed, forward and gradient."""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._shared_memory import spaces_with_and_without_limit

import ejkernel
from ejkernel.specs.mean_pooling import mean_pooling_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.mean_pooling import MeanPoolingConfig

#: 16-token steps, 32 columns and 2 parts: tiles that cut sequences and columns.
SMALL = MeanPoolingConfig(block_t=16, block_d=32, split=2, num_stages=1)


def compare(x: jax.Array, cu_seqlens: Any = None, cfg: Any = SMALL) -> jax.Array:
    """Output and gradient against the reference, at the dtype's tolerance."""

    def ours(x):
        return ejkernel.mean_pooling(x, cu_seqlens=cu_seqlens, platform="triton", cfg=cfg)

    out, vjp = jax.vjp(ours, x)
    want, vjp_w = jax.vjp(lambda x: mean_pooling_reference(x, cu_seqlens=cu_seqlens), x)
    assert out.dtype == x.dtype and out.shape == want.shape
    assert_close(out, want, name="out")
    d_out = normal(jax.random.PRNGKey(1), out.shape, out.dtype)
    (dx,), (dx_w,) = vjp(d_out), vjp_w(d_out)
    assert dx.dtype == x.dtype
    assert_close(dx, dx_w, name="dx")
    return dx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cfg", [SMALL, None], ids=["small", "default"])
def test_dense(interpret: None, dtype: Any, cfg: Any) -> None:
    compare(normal(jax.random.PRNGKey(0), (3, 37, 80), dtype), cfg=cfg)


def test_one_unpacked_sequence(interpret: None) -> None:
    compare(normal(jax.random.PRNGKey(0), (37, 48)))


@pytest.mark.parametrize("layout", ["[T, D]", "[1, T, D]"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packed_with_an_empty_sequence_and_tokens_outside(
    interpret: None, layout: str, dtype: Any
) -> None:
    # tokens 0..2 and 90..99 belong to no sequence; sequence 1 is empty; the last offset is
    # past T (clipped)
    x = normal(jax.random.PRNGKey(2), (100, 80), dtype)
    x = x if layout == "[T, D]" else x[None]
    cu = jnp.asarray([3, 40, 40, 77, 90], jnp.int32)
    dx = compare(x, cu)
    dx = dx.reshape(100, 80)
    assert float(jnp.abs(dx[:3].astype(jnp.float32)).max()) == 0.0
    assert float(jnp.abs(dx[90:].astype(jnp.float32)).max()) == 0.0
    compare(x, jnp.asarray([0, 37, 120], jnp.int32))


def test_jit_and_vmap(interpret: None) -> None:
    x = normal(jax.random.PRNGKey(3), (2, 3, 37, 16))

    def f(x):
        return ejkernel.mean_pooling(x, platform="triton", cfg=SMALL)

    assert_close(jax.jit(jax.vmap(f))(x), jax.vmap(mean_pooling_reference)(x), name="vmap")
    loss = lambda fn: lambda x: jnp.sum(jnp.sin(fn(x)))
    g = jax.jit(jax.vmap(jax.grad(loss(f))))(x)
    assert_close(g, jax.vmap(jax.grad(loss(mean_pooling_reference)))(x), name="vmap grad")


def test_the_default_call_selects_triton(interpret: None) -> None:
    x = normal(jax.random.PRNGKey(4), (2, 37, 16))
    assert ejkernel.explain("mean_pooling", x).platform == "triton"
    assert_close(ejkernel.mean_pooling(x), mean_pooling_reference(x))


def test_config_space_prunes_by_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from ejkernel_triton.ops import mean_pooling as op

    monkeypatch.setattr(op._launch, "interpreting", lambda: False)
    inv = types.SimpleNamespace(kwargs={"x": jax.ShapeDtypeStruct((8, 4096, 1024), jnp.float32)})
    every, kept = spaces_with_and_without_limit(monkeypatch, lambda: op.config_space(inv), 70000)
    assert kept[0] == every[0] == op.heuristic(inv)
    assert 1 < len(kept) < len(every)
    assert all(op.smem_need(4, cfg) <= 70000 for cfg in kept)


# -- GPU: realistic shapes against the XLA platform -------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_realistic_shapes_match_the_xla_platform(packed: bool) -> None:
    if packed:
        x = normal(jax.random.PRNGKey(5), (1, 65536, 1024), jnp.bfloat16)
        cu = jnp.asarray([0, 100, 4096, 4096, 30000, 65000], jnp.int32)
    else:
        x, cu = normal(jax.random.PRNGKey(5), (8, 8192, 1024), jnp.bfloat16), None

    def run(platform: str) -> Any:
        f = lambda x: ejkernel.mean_pooling(x, cu_seqlens=cu, platform=platform)
        out, vjp = jax.vjp(f, x)
        return out, vjp(jnp.ones_like(out))[0]

    got, want = jax.jit(lambda: run("triton"))(), jax.jit(lambda: run("xla"))()
    for a, e in zip(got, want, strict=True):
        a, e = a.astype(jnp.float32), e.astype(jnp.float32)
        assert float(jnp.linalg.norm(a - e) / jnp.linalg.norm(e)) < 1e-2
