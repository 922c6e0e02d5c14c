"""The XLA mean pooling against the reference: dense, packed (empty sequences), gradients, tracing.

Every call goes through the public ``ejkernel.mean_pooling`` (the executor wires the custom
VJP); gradients are ``jax.vjp`` of it against ``jax.vjp`` of the reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.specs.mean_pooling import mean_pooling_reference, mean_pooling_synthetic
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

#: Packed offsets over T = 129 tokens: empty sequences first, in the middle and last, and
#: tokens before the first offset and after the last one that belong to no sequence.
PACKED = (3, 3, 40, 41, 41, 100, 120, 120)
NUM_TOKENS = 129


def check(x: jax.Array, cu_seqlens: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Compare output and gradient with the reference (each side one ``jax.jit``); return ours."""

    def fwd_bwd(fn: Any) -> Any:
        @jax.jit
        def run(x: Any, cu: Any) -> Any:
            out, vjp = jax.vjp(lambda x: fn(x, cu_seqlens=cu), x)
            d_out = normal(jax.random.PRNGKey(42), out.shape, out.dtype)
            return out, vjp(d_out)[0]

        return run(x, cu_seqlens)

    out, d_x = fwd_bwd(ejkernel.mean_pooling)
    ref_out, ref_d_x = fwd_bwd(mean_pooling_reference)
    assert out.dtype == x.dtype and d_x.dtype == x.dtype and d_x.shape == x.shape
    assert_close(out, ref_out, name="out")
    assert_close(d_x, ref_d_x, name="dx")
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    return out, d_x


#: Every shape in float32, bfloat16 once: the dtype takes the same path at every shape.
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 37, 80), jnp.float32),
        ((3, 1, 48), jnp.float32),
        ((1, 129, 64), jnp.float32),
        ((2, 37, 80), jnp.bfloat16),
    ],
    ids=["B2-S37-D80-f32", "B3-S1-D48-f32", "B1-S129-D64-f32", "B2-S37-D80-bf16"],
)
def test_dense_mean_and_gradient_match_the_reference(
    shape: tuple[int, int, int], dtype: Any
) -> None:
    x = normal(jax.random.PRNGKey(0), shape, dtype)
    out, _ = check(x)
    assert out.shape == (shape[0], shape[2])


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [("T-D", jnp.float32), ("T-D", jnp.bfloat16), ("1-T-D", jnp.float32)],
    ids=["f32-T-D", "bf16-T-D", "f32-1-T-D"],
)
def test_packed_sequences_with_empty_ones_give_zero_rows_and_no_nan(
    layout: str, dtype: Any
) -> None:
    x = normal(jax.random.PRNGKey(1), (NUM_TOKENS, 80), dtype)
    if layout == "1-T-D":
        x = x[None]
    cu = jnp.asarray(PACKED, jnp.int32)
    out, d_x = check(x, cu)
    assert out.shape == (len(PACKED) - 1, 80)
    lengths = np.diff(PACKED)
    assert np.all(np.asarray(out, np.float32)[lengths == 0] == 0.0)
    assert np.all(np.asarray(out, np.float32)[lengths > 0] != 0.0)
    d_tokens = np.asarray(d_x, np.float32).reshape(NUM_TOKENS, 80)
    assert np.all(d_tokens[: PACKED[0]] == 0.0) and np.all(d_tokens[PACKED[-1] :] == 0.0)


def test_packed_layouts_agree_and_one_unpacked_sequence_is_its_mean() -> None:
    x = normal(jax.random.PRNGKey(2), (NUM_TOKENS, 48))
    cu = jnp.asarray(PACKED, jnp.int32)
    flat = ejkernel.mean_pooling(x, cu_seqlens=cu)
    batched = ejkernel.mean_pooling(x[None], cu_seqlens=cu)
    assert_close(flat, batched)
    whole, _ = check(x)  # [T, D] without cu_seqlens: one sequence
    assert whole.shape == (1, 48)
    assert_close(whole, jnp.mean(x, axis=0, keepdims=True))


def test_offsets_past_the_tokens_are_clipped() -> None:
    x = normal(jax.random.PRNGKey(3), (37, 16))
    out, _ = check(x, jnp.asarray([-5, 10, 30, 60, 90], jnp.int32))
    assert_close(out[0], jnp.mean(x[:10], axis=0))
    assert_close(out[2], jnp.mean(x[30:], axis=0))
    assert np.all(np.asarray(out[3]) == 0.0)


def test_empty_dense_sequences_give_zeros() -> None:
    out = ejkernel.mean_pooling(jnp.ones((2, 0, 8)))
    assert out.shape == (2, 8) and np.all(np.asarray(out) == 0.0)


def test_one_compiled_function_serves_every_packing() -> None:
    x = normal(jax.random.PRNGKey(4), (NUM_TOKENS, 32))
    traces = []

    def fwd_bwd(fn: Any, cu: Any) -> Any:
        out, vjp = jax.vjp(lambda x: fn(x, cu_seqlens=cu), x)
        return out, vjp(jnp.cos(out))

    @jax.jit
    def ours(cu: Any) -> Any:
        traces.append(1)
        return fwd_bwd(ejkernel.mean_pooling, cu)

    reference = jax.jit(lambda cu: fwd_bwd(mean_pooling_reference, cu))
    rng = np.random.default_rng(0)
    for _ in range(4):
        cu = jnp.asarray(np.sort(rng.integers(0, NUM_TOKENS + 1, 6)), jnp.int32)
        assert_close(ours(cu), reference(cu), name=f"offsets {np.asarray(cu)}")
    assert len(traces) == 1


def test_vmap_over_batches_and_packings() -> None:
    x = normal(jax.random.PRNGKey(5), (3, 2, 37, 16))
    ours = jax.jit(
        jax.vmap(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(ejkernel.mean_pooling(x)))))
    )
    ref = jax.jit(
        jax.vmap(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(mean_pooling_reference(x)))))
    )
    assert_close(ours(x), ref(x))
    tokens = x[0, 0]
    cus = jnp.asarray([[0, 5, 5, 37], [2, 20, 30, 30]], jnp.int32)
    pooled = jax.jit(jax.vmap(lambda cu: ejkernel.mean_pooling(tokens, cu_seqlens=cu)))(cus)
    expected = jax.vmap(lambda cu: mean_pooling_reference(tokens, cu_seqlens=cu))(cus)
    assert_close(pooled, expected)


def test_explain_reports_the_configless_xla_implementation() -> None:
    x = normal(jax.random.PRNGKey(6), (NUM_TOKENS, 8))
    sel = ejkernel.explain("mean_pooling", x, cu_seqlens=jnp.asarray(PACKED, jnp.int32))
    assert sel.platform == "xla" and sel.config is None


def _errors() -> list[tuple[str, dict[str, Any], type, str]]:
    x = normal(jax.random.PRNGKey(7), (2, 37, 8))
    cu = jnp.asarray([0, 10, 37], jnp.int32)
    return [
        ("x-1d", {"x": x[0, 0]}, ValueError, "`x` must be [B, S, D] or [T, D]; got x.shape=(8,)"),
        ("x-int", {"x": jnp.ones((2, 3, 4), jnp.int32)}, TypeError, "`x` must be a floating array"),
        ("x-not-array", {"x": [[1.0]]}, TypeError, "`x` must be an array"),
        (
            "batched-x-with-offsets",
            {"x": x, "cu_seqlens": cu},
            ValueError,
            "`x` must be packed [T, D] or [1, T, D]; got x.shape=(2, 37, 8)",
        ),
        (
            "offsets-float",
            {"x": x[0], "cu_seqlens": cu.astype(jnp.float32)},
            TypeError,
            "`cu_seqlens` must be an integer array",
        ),
        (
            "offsets-2d",
            {"x": x[0], "cu_seqlens": cu[None]},
            ValueError,
            "`cu_seqlens` must be [N + 1]; got cu_seqlens.shape=(1, 3)",
        ),
        ("offsets-no-sequence", {"x": x[0], "cu_seqlens": cu[:1]}, ValueError, "N >= 1 sequences"),
    ]


@pytest.mark.parametrize(
    ("case", "args", "error", "message"), _errors(), ids=[e[0] for e in _errors()]
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    case: str, args: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error) as info:
        ejkernel.mean_pooling(**args)
    assert str(info.value).startswith("mean_pooling: ")
    assert message in str(info.value)


def test_autotuning_inputs_are_valid_offsets() -> None:
    abstract = {
        "x": jax.ShapeDtypeStruct((1, NUM_TOKENS, 8), jnp.bfloat16),
        "cu_seqlens": jax.ShapeDtypeStruct((5,), jnp.int32),
    }
    concrete = mean_pooling_synthetic(abstract)
    offsets = np.asarray(concrete["cu_seqlens"])
    assert offsets[0] == 0 and offsets[-1] == NUM_TOKENS and np.all(np.diff(offsets) > 0)
    assert concrete["x"].dtype == jnp.bfloat16
