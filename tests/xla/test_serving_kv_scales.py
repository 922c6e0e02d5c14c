"""The XLA serving ops read float8 KV caches with ``k_scale``/``v_scale``, and
``ragged_page_attention_v3`` writes its new tokens quantised.

Every serving op, on random float8_e4m3fn caches with per-tensor and per-KV-head scales, must
match the op's reference run on the dequantised float32 caches (``cache.astype(float32) ·
scale``) without scales; v3's written slots must equal NumPy's (ml_dtypes) round-to-nearest of
the saturated ``x / scale``. Batches are the hostile ones of the paged tests (shuffled pages,
garbage table slots, NaN in every slot no sequence owns).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel.attention_semantics import dequantize_kv
from ejkernel.specs import builtin_spec
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import FP8, PagedBatch
from ejkernel.testing.cases.ragged_decode_attention import rows_example

#: Lengths 0 and 1, partial and whole pages, a chunked prefill, decode steps, GQA.
PACKED = PagedBatch(
    kv_lens=(37, 0, 1, 8, 19), q_lens=(5, 0, 1, 8, 2), hq=6, hkv=2, d=40, page_size=4,
    max_pages=11, num_pages=40,
)  # fmt: skip
DECODE = PagedBatch(
    kv_lens=(37, 0, 1, 16, 29), hq=6, hkv=2, d=40, page_size=8, max_pages=5, num_pages=24
)
PREFILL = PagedBatch(
    kv_lens=(37,), q_lens=(5,), hq=6, hkv=2, d=40, page_size=8, max_pages=6, num_pages=16
)
#: op -> how its conformance-style example is built for a cache dtype.
EXAMPLES = {
    "page_attention": lambda cache: DECODE.example("decode", cache_dtype=cache),
    "prefill_page_attention": lambda cache: PREFILL.example("prefill", cache_dtype=cache),
    "ragged_page_attention": lambda cache: PACKED.example(num_seqs=4, cache_dtype=cache),
    "ragged_page_attention_v3": lambda cache: PACKED.example(
        num_seqs=5, new_tokens=True, cache_dtype=cache
    ),
    "unified_attention": lambda cache: PACKED.example(cache_dtype=cache),
    "ragged_decode_attention": lambda cache: rows_example(
        (0, 5, 20), (37, 30, 37), sk=37, hq=6, hkv=2, d=40, cache_dtype=cache
    ),
}
#: Per-KV-head (Hkv = 2) and per-tensor scales.
SCALES = {
    "per-head": {"k_scale": np.array([0.5, 1.75], np.float32), "v_scale": np.array([2.0, 0.25])},
    "per-tensor": {"k_scale": 0.625, "v_scale": 1.5},
}


def caches_of(op: str) -> tuple[str, str]:
    return ("key", "value") if op == "ragged_decode_attention" else ("key_cache", "value_cache")


def scales(kind: str) -> dict[str, Any]:
    """The scales of ``kind``, arrays as float32 ``jax.Array``."""
    return {
        k: jnp.asarray(v, jnp.float32) if isinstance(v, np.ndarray) else v
        for k, v in SCALES[kind].items()
    }


def build(op: str, dtype: str = "float32", cache: str = FP8) -> dict[str, Any]:
    return EXAMPLES[op](cache).build(builtin_spec(op), dtype)


def dequantised(op: str, args: dict[str, Any], sc: dict[str, Any]) -> dict[str, Any]:
    """``args`` with float32 caches ``cache.astype(float32) · scale`` and no scales."""
    key, value = caches_of(op)
    return {
        **args,
        key: dequantize_kv(args[key], sc["k_scale"]),
        value: dequantize_kv(args[value], sc["v_scale"]),
    }


def reference(op: str, args: dict[str, Any]) -> Any:
    spec = builtin_spec(op)
    return spec.reference(**helpers.validated(spec, args))


def call(op: str, args: dict[str, Any]) -> Any:
    return getattr(ejkernel, op)(**args, platform="xla")


@pytest.mark.parametrize("kind", sorted(SCALES))
@pytest.mark.parametrize("op", [op for op in sorted(EXAMPLES) if op != "ragged_page_attention_v3"])
def test_float8_caches_match_the_reference_on_dequantised_caches(op: str, kind: str) -> None:
    args = build(op)
    sc = scales(kind)
    out = call(op, {**args, **sc})
    assert out.dtype == jnp.float32
    expected = reference(op, dequantised(op, args, sc))
    helpers.assert_output(out, expected, expected.shape, "float32", f"{op}-{kind}")
    assert_close(reference(op, {**args, **sc}), expected, name="reference with scales")


@pytest.mark.parametrize("kind", sorted(SCALES))
def test_v3_attends_over_the_quantised_update(kind: str) -> None:
    """v3's output is ragged paged attention over the caches it returns (the new tokens
    quantised), read with the same scales; its caches are the reference's, bit for bit."""
    args = build("ragged_page_attention_v3")
    sc = scales(kind)
    out, key_cache, value_cache = call("ragged_page_attention_v3", {**args, **sc})
    assert key_cache.dtype == value_cache.dtype == jnp.dtype(FP8)
    want_out, want_k, want_v = reference("ragged_page_attention_v3", {**args, **sc})
    for got, want in ((key_cache, want_k), (value_cache, want_v)):
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want, np.float32), strict=True
        )
    packed = {k: v for k, v in args.items() if k not in ("keys", "values")}
    updated = {**packed, "key_cache": key_cache, "value_cache": value_cache}
    expected = reference("ragged_page_attention", dequantised("ragged_page_attention", updated, sc))
    helpers.assert_output(out, expected, expected.shape, "float32", f"v3-{kind}")
    assert_close(want_out, expected, name="reference with scales")


def test_v3_quantises_new_tokens_to_nearest_and_saturates() -> None:
    """Keys at ties (17 → 16, 19 → 20 with scale 1 on head 0: ties to even), past ±448
    (saturated, Inf too) and ordinary values; NaN stays NaN. Per-head key scales, a float
    value scale: each written slot equals ml_dtypes' cast of the saturated ``x / scale``."""
    batch = PagedBatch(
        kv_lens=(9, 4), q_lens=(6, 2), hq=2, hkv=2, d=8, page_size=4, max_pages=3, num_pages=8
    )
    spec = builtin_spec("ragged_page_attention_v3")
    args = batch.example(num_seqs=2, new_tokens=True, cache_dtype=FP8).build(spec, "float32")
    keys = np.asarray(args["keys"]).copy()
    keys[0, 0, :6] = [17.0, 19.0, 1e4, -1e4, np.inf, -np.inf]
    keys[1, 0, :3] = [np.nan, 0.3, 447.9]
    values = np.asarray(args["values"]) * 600.0  # many beyond 448 · 0.5
    k_scale, v_scale = np.array([1.0, 0.37], np.float32), 0.5
    _, key_cache, value_cache = call(
        "ragged_page_attention_v3",
        {**args, "keys": jnp.asarray(keys), "values": jnp.asarray(values),
         "k_scale": jnp.asarray(k_scale), "v_scale": v_scale},
    )  # fmt: skip
    tables = np.asarray(args["block_tables"])
    for t, (s, i) in enumerate([(0, i) for i in range(6)] + [(1, i) for i in range(2)]):
        pos = batch.kv_lens[s] - batch.q_lens[s] + i
        page, slot = tables[s, pos // batch.page_size], pos % batch.page_size
        for cache, new, scale in (
            (key_cache, keys, k_scale[:, None]),
            (value_cache, values, v_scale),
        ):
            want = np.clip(new[t] / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
            got = np.asarray(cache)[page, slot]
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    first = np.asarray(key_cache, np.float32)[tables[0, 0], 3, 0, :6]  # token 0, position 3
    np.testing.assert_array_equal(first, [16.0, 20.0, 448.0, -448.0, 448.0, -448.0])


def test_bfloat16_queries_read_float8_caches() -> None:
    """The output keeps the queries' dtype; bfloat16 tolerance against the float32 reference
    on the dequantised caches."""
    args = build("ragged_page_attention", "bfloat16")
    sc = scales("per-head")
    out = call("ragged_page_attention", {**args, **sc})
    assert out.dtype == jnp.bfloat16
    expected = reference(
        "ragged_page_attention",
        {**dequantised("ragged_page_attention", args, sc), "queries": args["queries"].astype(
            jnp.float32
        )},
    )  # fmt: skip
    assert_close(out, expected, dtype=jnp.bfloat16, name="bf16 queries, fp8 caches")


@pytest.mark.parametrize("op", ["page_attention", "ragged_decode_attention"])
def test_a_wider_cache_with_scales_is_read_by_the_same_formula(op: str) -> None:
    args = build(op, cache="float")
    sc = scales("per-head")
    out = call(op, {**args, **sc})
    expected = reference(op, dequantised(op, args, sc))
    helpers.assert_output(out, expected, expected.shape, "float32", op)


def test_scales_may_be_traced() -> None:
    """Array scales (per head, and a float32 scalar) are arguments of one compiled call."""
    args = build("unified_attention")
    step = jax.jit(lambda k, v: ejkernel.unified_attention(**args, k_scale=k, v_scale=v))
    for k, v in ((np.float32(0.5), np.array([1.0, 2.0], np.float32)), (np.float32(3.0), 0.25)):
        out = step(jnp.asarray(k), jnp.asarray(v, jnp.float32))
        assert_close(out, call("unified_attention", {**args, "k_scale": k, "v_scale": v}))


def float8_decode_shapes(num_pages: int) -> dict[str, Any]:
    """Abstract page_attention arguments over a float8 cache of ``num_pages`` pages."""
    batch = PagedBatch(
        kv_lens=(37, 1, 64), hq=4, hkv=2, d=64, page_size=16, max_pages=8, num_pages=num_pages
    )
    spec = builtin_spec("page_attention")
    args = helpers.validated(
        spec, batch.example("decode", cache_dtype=FP8).build(spec), **SCALES["per-tensor"]
    )
    return {k: helpers.abstract(v) for k, v in args.items() if hasattr(v, "shape")}


def test_a_float8_cache_is_gathered_as_float8_pages() -> None:
    """The program gathers float8 pages inside its loop and dequantises only what it gathered:
    no conversion of a whole cache, so the K/V read is float8."""
    from ejkernel_xla.ops.page_attention import page_attention_xla

    text = jax.jit(lambda a: page_attention_xla(**a)).lower(float8_decode_shapes(512)).as_text()
    cache = "tensor<512x16x2x64xf8E4M3FN>"
    lines = text.splitlines()
    assert sum("stablehlo.gather" in line and cache in line for line in lines) == 2
    assert not [line for line in lines if "stablehlo.convert" in line and cache in line]


@pytest.mark.gpu
def test_a_float8_cache_is_never_converted_whole_on_the_gpu() -> None:
    """Compiled for the GPU, the decode's temporaries stay far below a float32 copy of the cache
    and do not grow with it. (XLA:CPU upcasts narrow floats whole before a gather, bfloat16
    caches too, so this holds on the GPU only.)"""
    from ejkernel_xla.ops.page_attention import page_attention_xla

    small, large = (
        helpers.temp_bytes(page_attention_xla, float8_decode_shapes(n)) for n in (512, 8192)
    )
    assert large < 8192 * 16 * 2 * 64 * 4 // 8 and large < 2 * small + (1 << 20)
