"""The native CUDA mean_pooling kernels (forward and backward, dense and packed) against the
reference and its autodiff, on an NVIDIA GPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.specs.mean_pooling import mean_pooling_reference
from ejkernel.testing import assert_close

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def normal(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def check(x: jax.Array, cu_seqlens: jax.Array | None = None, grad: bool = True) -> None:
    out = ejkernel.mean_pooling(x, cu_seqlens=cu_seqlens, platform="cuda")
    with jax.default_matmul_precision("highest"):  # the packed oracle is an einsum
        expected = mean_pooling_reference(x, cu_seqlens=cu_seqlens)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert_close(out, expected, name=f"{x.shape}")
    if not grad:
        return
    w = normal(expected.shape, jnp.float32, seed=1)

    def loss(fn: Any) -> Any:
        return lambda x: jnp.sum(fn(x).astype(jnp.float32) * w)

    ours = jax.grad(
        loss(lambda x: ejkernel.mean_pooling(x, cu_seqlens=cu_seqlens, platform="cuda"))
    )(x)
    with jax.default_matmul_precision("highest"):
        theirs = jax.grad(loss(lambda x: mean_pooling_reference(x, cu_seqlens=cu_seqlens)))(x)
    assert ours.dtype == x.dtype
    assert_close(ours, theirs, name=f"grad {x.shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize(
    "shape",
    [(3, 37, 80), (2, 1000, 4096), (4, 129, 37), (1, 1, 8)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_dense_matches_the_reference(dtype: Any, shape: tuple[int, ...]) -> None:
    check(normal(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
def test_packed_with_empty_sequences_and_tokens_outside_matches(dtype: Any) -> None:
    # Tokens [0, 3) and [97, 100) belong to no sequence; sequences 2 and 5 are empty.
    cu = jnp.asarray([3, 20, 57, 57, 58, 97, 97], jnp.int32)
    check(normal((100, 48), dtype), cu)
    check(normal((1, 100, 37), dtype), cu)  # [1, T, D] layout, odd D (scalar path)


def test_packed_long_sequences_split_across_ctas() -> None:
    cu = jnp.asarray([0, 5000, 5001, 12000], jnp.int32)
    check(normal((12000, 256), jnp.bfloat16), cu)


def test_one_unpacked_sequence() -> None:
    check(normal((77, 24), jnp.float32))


def test_offsets_past_the_tokens_are_clipped() -> None:
    check(normal((50, 16), jnp.float32), jnp.asarray([-4, 10, 60, 80], jnp.int32))


def test_jit_and_vmap() -> None:
    xs = normal((3, 2, 33, 64), jnp.float32)
    out = jax.jit(jax.vmap(lambda x: ejkernel.mean_pooling(x, platform="cuda")))(xs)
    for i in range(3):
        assert_close(out[i], mean_pooling_reference(xs[i]))


def test_selected_on_the_gpu() -> None:
    x = normal((2, 64, 128), jnp.bfloat16)
    record = ejkernel.explain("mean_pooling", x)
    assert record.platform == "cuda", record.rejected
