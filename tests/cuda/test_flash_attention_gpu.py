"""The cuDNN route of ``flash_attention`` / ``scaled_dot_product_attention`` against the
reference (forward and gradients), and selection moving on when cuDNN declines, on an NVIDIA
GPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close

pytestmark = pytest.mark.gpu


def inputs(
    b: int = 2,
    sq: int = 128,
    sk: int = 128,
    hq: int = 8,
    hkv: int = 2,
    d: int = 128,
    dtype: Any = jnp.bfloat16,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    return tuple(  # type: ignore[return-value]
        jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
        for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    )


def reference(*args: Any, **kw: Any) -> jax.Array:
    with jax.default_matmul_precision("highest"):
        return flash_attention_reference(*args, **kw)


def check(q: jax.Array, k: jax.Array, v: jax.Array, grad: bool = True, **kw: Any) -> None:
    record = ejkernel.explain("flash_attention", q, k, v, **kw)
    assert record.platform == "cuda", record.rejected
    out = ejkernel.flash_attention(q, k, v, **kw)
    assert_close(out, reference(q, k, v, **kw), name=str(kw))
    if not grad:
        return
    w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape, np.float32))

    def loss(fn: Any) -> Any:
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    ours = jax.grad(loss(lambda q, k, v: ejkernel.flash_attention(q, k, v, **kw)), (0, 1, 2))(
        q, k, v
    )
    with jax.default_matmul_precision("highest"):
        theirs = jax.grad(
            loss(lambda q, k, v: flash_attention_reference(q, k, v, **kw)), (0, 1, 2)
        )(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    assert_close(ours, theirs, dtype=q.dtype, scale=4.0, name=f"grad {kw}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_cudnn_matches_the_reference(causal: bool, d: int) -> None:
    check(*inputs(d=d), causal=causal)


def test_cudnn_sliding_window() -> None:
    check(*inputs(), causal=True, sliding_window=(32, 0))
    check(*inputs(), sliding_window=(17, 0))


def test_cudnn_short_query_sees_the_whole_cache() -> None:
    check(*inputs(sq=2, sk=1000), grad=False)


@pytest.mark.parametrize(
    ("causal", "why"), [(False, "even sequence lengths"), (True, "top-left aligned")]
)
def test_a_single_query_is_declined_for_its_odd_length_or_its_causal_mask(causal, why) -> None:
    q, k, v = inputs(sq=1, sk=1000)
    record = ejkernel.explain("flash_attention", q, k, v, causal=causal)
    assert record.platform != "cuda" and why in record.rejected["cuda"], record.rejected
    out = ejkernel.flash_attention(q, k, v, causal=causal)
    assert_close(out, reference(q, k, v, causal=causal))


def test_cudnn_bias_and_mask_with_a_fully_masked_row() -> None:
    q, k, v = inputs()
    rng = np.random.default_rng(2)
    bias = jnp.asarray(rng.standard_normal((1, 8, 128, 128), np.float32), jnp.bfloat16)
    check(q, k, v, bias=bias)
    mask = rng.random((2, 1, 128, 128)) > 0.3
    mask[1, 0, 5, :] = False  # a row that sees nothing returns zeros
    mask = jnp.asarray(mask)
    check(q, k, v, attention_mask=mask)
    out = ejkernel.flash_attention(q, k, v, attention_mask=mask)
    assert np.all(np.asarray(out[1, 5], np.float32) == 0.0)


def test_sdpa_runs_on_cudnn() -> None:
    q, k, v = inputs()
    record = ejkernel.explain("scaled_dot_product_attention", q, k, v, causal=True)
    assert record.platform == "cuda", record.rejected
    out = ejkernel.scaled_dot_product_attention(q, k, v, causal=True)
    assert_close(out, reference(q, k, v, causal=True))


def test_declined_calls_move_on_to_another_platform() -> None:
    q, k, v = inputs(sq=37, sk=129, d=80)
    record = ejkernel.explain("flash_attention", q, k, v, causal=True)
    assert record.platform != "cuda" and "top-left" in record.rejected["cuda"]
    record = ejkernel.explain("flash_attention", *inputs(), logits_soft_cap=30.0)
    assert record.platform != "cuda" and "soft cap" in record.rejected["cuda"]
