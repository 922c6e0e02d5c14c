"""The Triton serving kernels' float8 caches, ``ragged_decode_attention`` and
``ragged_page_attention_v3`` (the in-place cache update) against each op's reference.

In Triton's interpreter on the CPU at tiny shapes, with small tiles so batches cross several
tiles, pages and splits; cache slots no sequence owns hold NaN, table slots past the live
pages hold garbage ids. Float8 caches are compared with the reference on the same float8
caches (which reads them dequantised). ``gpu``-marked tests check the aliasing of the
compiled update and serving shapes against XLA.
"""

from __future__ import annotations

import collections
import functools
import re
import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.specs._paged import paged_block_tables
from ejkernel.specs.page_attention import page_attention_reference
from ejkernel.specs.prefill_page_attention import prefill_page_attention_reference
from ejkernel.specs.ragged_decode_attention import ragged_decode_attention_reference
from ejkernel.specs.ragged_page_attention import ragged_page_attention_reference
from ejkernel.specs.ragged_page_attention_v3 import ragged_page_attention_v3_reference
from ejkernel.specs.unified_attention import unified_attention_reference

pytest.importorskip("triton")

from tests.triton import _paged_helpers
from tests.triton._paged_helpers import check, small

FP8 = jnp.float8_e4m3fn


#: :func:`~tests.triton._paged_helpers.packed` with the caches (and new tokens) drawn times 2.
packed = functools.partial(_paged_helpers.packed, cache_scale=2.0)


def _f32(x: Any) -> Any:
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


#: Per-tensor and per-KV-head scales.
SCALES = {
    "tensor": {"k_scale": 0.5, "v_scale": 1.5},
    "head": {"k_scale": np.array([0.5, 1.25], np.float32), "v_scale": 0.75},
}


# -- float8 caches in the ops already served ------------------------------------------------


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("splits", [1, 3])
def test_unified_attention_fp8(interpret: None, scales: str, splits: int) -> None:
    a = packed([37, 1, 20, 0], [5, 1, 20, 0], cache_dtype=FP8)
    opts = {**SCALES[scales], "softmax_aux": jnp.linspace(-1, 1, 4)}
    out = ejkernel.unified_attention(**a, **opts, platform="triton", cfg=small(splits=splits))
    check(out, unified_attention_reference(**a, **opts))


def test_fp8_bf16_queries_every_paged_op(interpret: None) -> None:
    """bfloat16 queries over float8 caches: ragged (``num_seqs`` below the rows) and page
    attention; float32 queries in prefill attention."""
    a = packed([29, 0, 1, 18], [6, 0, 1, 3], extra_rows=1, dtype=jnp.bfloat16, cache_dtype=FP8)
    opts = SCALES["head"]
    out = ejkernel.ragged_page_attention(**a, num_seqs=3, **opts, platform="triton", cfg=small())
    ref = ragged_page_attention_reference(
        **{**a, "queries": _f32(a["queries"])}, num_seqs=3, **opts
    )
    check(out, ref, dtype=jnp.bfloat16)

    d = packed([1, 47, 16], [1, 1, 1], hq=8, dtype=jnp.bfloat16, cache_dtype=FP8, seed=1)
    names = ("key_cache", "value_cache", "kv_lens", "block_tables")
    dargs = {"query": d["queries"], **{n: d[n] for n in names}}
    out = ejkernel.page_attention(**dargs, **opts, platform="triton", cfg=small(splits=2))
    ref = page_attention_reference(**{**dargs, "query": _f32(dargs["query"])}, **opts)
    check(out, ref, dtype=jnp.bfloat16)

    p = packed([45], [13], hq=2, hkv=1, d=32, cache_dtype=FP8, seed=2)
    pargs = {
        "query": p["queries"],
        "key_cache": p["key_cache"],
        "value_cache": p["value_cache"],
        "kv_len": 45,
        "page_indices": p["block_tables"][0],
    }
    opts = SCALES["tensor"]
    out = ejkernel.prefill_page_attention(**pargs, **opts, platform="triton", cfg=small())
    check(out, prefill_page_attention_reference(**pargs, **opts))


@pytest.mark.parametrize("d", [64, 80])
def test_fp8_v_tiles_as_words(interpret: None, d: int) -> None:
    """``fp8_v_words``: the float8 V tile loaded as 32-bit words and widened in registers
    gives the reference's output, bfloat16 queries (float16 products) and float32 ones, a
    decode batch with splits and a ragged one, pages past the lengths holding NaN."""
    cfg = attrs.evolve(small(splits=2), fp8_v_words=True)
    a = packed([37, 1, 20, 0], [5, 1, 20, 0], d=d, dtype=jnp.bfloat16, cache_dtype=FP8)
    opts = SCALES["head"]
    out = ejkernel.unified_attention(**a, **opts, platform="triton", cfg=cfg)
    ref = unified_attention_reference(**{**a, "queries": _f32(a["queries"])}, **opts)
    check(out, ref, dtype=jnp.bfloat16)
    f = packed([29, 47, 1], [1, 1, 1], hq=8, d=d, cache_dtype=FP8, seed=1)
    names = ("key_cache", "value_cache", "kv_lens", "block_tables")
    dargs = {"query": f["queries"], **{n: f[n] for n in names}}
    out = ejkernel.page_attention(**dargs, **SCALES["tensor"], platform="triton", cfg=cfg)
    check(out, page_attention_reference(**dargs, **SCALES["tensor"]))


def test_fp8_with_bf16_queries_beyond_float16s_range(interpret: None) -> None:
    """bfloat16 queries over float8 caches take products in float16 (``F16_PRODUCTS``): rows
    whose entries reach 3e5, 1e7 and 6e4, past float16's 65504, are scaled down and back
    exactly, as is a row of zeros; the others are untouched."""
    a = packed([29, 1, 18], [6, 1, 3], dtype=jnp.bfloat16, cache_dtype=FP8, seed=3)
    q = np.asarray(a["queries"], np.float32)
    q[0, 0] *= 3e5 / np.abs(q[0, 0]).max()
    q[2, 1] *= 1e7 / np.abs(q[2, 1]).max()
    q[7, 3] *= 6e4 / np.abs(q[7, 3]).max()
    q[5, 2] = 0.0
    a["queries"] = jnp.asarray(q, jnp.bfloat16)
    opts = {**SCALES["head"], "softmax_scale": 1e-4}
    out = ejkernel.unified_attention(**a, **opts, platform="triton", cfg=small(splits=2))
    ref = unified_attention_reference(**{**a, "queries": _f32(a["queries"])}, **opts)
    check(out, ref, dtype=jnp.bfloat16)


# -- ragged_decode_attention ----------------------------------------------------------------


def dense(
    starts: list[int],
    ends: list[int],
    *,
    sk: int = 37,
    hq: int = 4,
    hkv: int = 2,
    d: int = 64,
    dv: int | None = None,
    dtype: Any = jnp.float32,
    cache_dtype: Any = None,
    seed: int = 0,
) -> dict[str, Any]:
    """A dense cache ``[B, Sk, Hkv, D]`` with NaN outside each row's ``[start, end)``."""
    rng = np.random.default_rng(seed)
    b = len(starts)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32) * 2
    v = rng.standard_normal((b, sk, hkv, dv or d)).astype(np.float32) * 2
    pos = np.arange(sk)
    outside = (pos < np.clip(starts, 0, sk)[:, None]) | (pos >= np.clip(ends, 0, sk)[:, None])
    k[outside], v[outside] = np.nan, np.nan
    cache_dtype = cache_dtype or dtype
    return {
        "query": jnp.asarray(rng.standard_normal((b, hq, d)), dtype),
        "key": jnp.asarray(k, cache_dtype),
        "value": jnp.asarray(v, cache_dtype),
        "sequence_start": jnp.asarray(starts, jnp.int32),
        "sequence_end": jnp.asarray(ends, jnp.int32),
    }


#: (starts, ends, batch options, op options, config): empty and length-1 ranges, ranges not
#: starting at 0, an end past the cache.
DECODE_CASES = {
    "ranges": ([0, 5, 20, 10, 36], [37, 5, 30, 11, 40], {}, {}, small()),
    "gqa-split-k": ([0, 3, 30], [37, 30, 31], {"hq": 8, "hkv": 2}, {}, small(splits=3)),
    "dv48": ([0, 3], [37, 30], {"dv": 48}, {}, small(splits=2)),
    "mqa-d80-heuristic": ([2, 0], [33, 1], {"hq": 4, "hkv": 1, "d": 80, "sk": 33}, {}, None),
    "sinks-cap-window": (
        [0, 3, 17],
        [37, 30, 20],
        {},
        {"sliding_window": (11, 0), "logits_soft_cap": 5.0, "softmax_aux": "sinks"},
        small(keys=32, splits=2),
    ),
    "fp8-head": ([0, 5, 20], [37, 30, 37], {"cache_dtype": FP8}, SCALES["head"], small()),
    "fp8-tensor-window": (
        [1, 0],
        [37, 9],
        {"cache_dtype": FP8},
        {**SCALES["tensor"], "sliding_window": 6},
        small(splits=2),
    ),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_ragged_decode_attention(interpret: None, case: str) -> None:
    starts, ends, batch, opts, cfg = DECODE_CASES[case]
    args = dense(starts, ends, **batch)
    if opts.get("softmax_aux") == "sinks":
        opts = {**opts, "softmax_aux": jax.random.normal(jax.random.PRNGKey(3), (4, 2))}
    out = ejkernel.ragged_decode_attention(**args, **opts, platform="triton", cfg=cfg)
    check(out, ragged_decode_attention_reference(**args, **opts))
    empty = np.asarray(ends) <= np.asarray(starts)
    if empty.any() and "softmax_aux" not in opts:
        assert not bool(jnp.any(out[empty])), "an empty range gives zeros"


def test_ragged_decode_attention_bf16_jit(interpret: None) -> None:
    args = dense([0, 4, 12], [37, 22, 13], hq=8, hkv=2, d=96, dtype=jnp.bfloat16)
    run = jax.jit(lambda a: ejkernel.ragged_decode_attention(**a, platform="triton", cfg=small()))
    ref = ragged_decode_attention_reference(**{n: _f32(x) for n, x in args.items()})
    check(run(args), ref, dtype=jnp.bfloat16)


def test_ragged_decode_attention_runs_the_kernel_by_default_where_triton_runs(
    interpret: None,
) -> None:
    from ejkernel_triton import plugin

    args = dense([0], [5])
    assert "ragged_decode_attention" not in plugin.OPT_IN
    assert "ragged_page_attention_v3" not in plugin.OPT_IN
    assert ejkernel.explain("ragged_decode_attention", **args).platform == "triton"


# -- ragged_page_attention_v3 ---------------------------------------------------------------


def v3_call(a: dict[str, Any], num_seqs: Any) -> tuple[Any, ...]:
    """``ragged_page_attention_v3``'s positional arguments."""
    names = ("queries", "keys", "values", "key_cache", "value_cache", "kv_lens")
    return (*(a[n] for n in names), a["block_tables"], a["query_start_loc"], num_seqs)


def check_v3(out: tuple[Any, ...], ref: tuple[Any, ...], dtype: Any = jnp.float32) -> None:
    check(out[0], ref[0], dtype)
    for ours, theirs in zip(out[1:], ref[1:], strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(
            np.asarray(ours.astype(jnp.float32)), np.asarray(theirs.astype(jnp.float32))
        )


@pytest.mark.parametrize(
    ("opts", "cfg"),
    [
        ({}, small()),
        (
            {"sliding_window": (6, 0), "logits_soft_cap": 10.0, "softmax_aux": "sinks"},
            small(splits=2),
        ),
        ({}, None),
    ],
    ids=["plain", "window-cap-sinks-split", "heuristic"],
)
def test_ragged_page_attention_v3(interpret: None, opts: dict[str, Any], cfg: Any) -> None:
    """``num_seqs`` (traced) below the rows, an empty sequence, a length-1 context, a last
    page partly filled, pad tokens: the caches equal the reference's bit for bit (NaN where
    no token was written), the outputs match."""
    a = packed([29, 0, 1, 18, 33], [6, 0, 1, 3, 16], extra_rows=2, pad_tokens=3, new_tokens=True)
    if opts.get("softmax_aux") == "sinks":
        opts = {**opts, "softmax_aux": jax.random.normal(jax.random.PRNGKey(2), (4,))}

    @jax.jit
    def ours(a: dict[str, Any], num_seqs: jax.Array) -> tuple[Any, ...]:
        return ejkernel.ragged_page_attention_v3(
            *v3_call(a, num_seqs), **opts, platform="triton", cfg=cfg
        )

    for live in (5, 3) if cfg is None else (3,):
        num_seqs = jnp.asarray(live, jnp.int32)
        out = ours(a, num_seqs)
        check_v3(out, ragged_page_attention_v3_reference(*v3_call(a, num_seqs), **opts))


@pytest.mark.parametrize("scales", list(SCALES))
def test_ragged_page_attention_v3_fp8(interpret: None, scales: str) -> None:
    """New tokens stored quantised with the caches' scales, read back dequantised."""
    a = packed([20, 1, 33], [4, 1, 3], dtype=jnp.bfloat16, cache_dtype=FP8, new_tokens=True, seed=4)
    opts = SCALES[scales]
    out = ejkernel.ragged_page_attention_v3(*v3_call(a, 3), **opts, platform="triton", cfg=small())
    a32 = {**a, **{n: _f32(a[n]) for n in ("queries", "keys", "values")}}
    ref = ragged_page_attention_v3_reference(*v3_call(a32, 3), **opts)
    check_v3(out, ref, dtype=jnp.bfloat16)


def test_ragged_page_attention_v3_bf16_donated(interpret: None) -> None:
    """Under ``jit`` with the caches donated, as a server calls it."""
    a = packed([40, 3, 17], [8, 1, 17], hq=8, hkv=2, dtype=jnp.bfloat16, new_tokens=True, seed=3)
    ref = ragged_page_attention_v3_reference(
        *v3_call({n: _f32(x) for n, x in a.items()}, 3), sliding_window=9
    )
    step = jax.jit(
        lambda *xs: ejkernel.ragged_page_attention_v3(
            *xs, sliding_window=9, platform="triton", cfg=small()
        ),
        donate_argnums=(3, 4),
    )
    out = step(*v3_call(a, 3))
    check(out[0], ref[0], dtype=jnp.bfloat16)
    for ours, theirs in zip(out[1:], ref[1:], strict=True):
        np.testing.assert_array_equal(
            np.asarray(ours.astype(jnp.float32)),
            np.asarray(theirs.astype(jnp.bfloat16).astype(jnp.float32)),
        )


def test_v3_update_aliases_the_caches() -> None:
    """The update's launch hands jax-triton the caches as outputs' buffers (array inputs 2 and
    3 alias outputs 0 and 1), shaped and typed as the caches; then the attention reads them."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops.ragged_page_attention_v3 import ragged_page_attention_v3_triton

    a = packed([20, 1], [4, 1], cache_dtype=FP8, new_tokens=True)
    with _codegen.recorded_launches() as record:
        ragged_page_attention_v3_triton(
            **{n: a[n] for n in a}, num_seqs=jnp.asarray(2), k_scale=0.5, v_scale=0.5
        )
    update, attention = record
    assert update.kernel.fn.__name__ == "write_tokens_kernel"
    assert update.input_output_aliases == ((2, 0), (3, 1))
    assert [(s.shape, s.dtype) for s in update.out_shape] == [
        (a["key_cache"].shape, FP8),
        (a["value_cache"].shape, FP8),
    ]
    assert attention.kernel.fn.__name__ == "unified_attention_kernel"


def test_fp8_kernel_compiles_for_hopper(hopper_compile: None) -> None:
    """The float8 decode compiles for sm_90 with 16-byte pipelined K/V copies (the tile of
    float8 is half the bytes of bfloat16's) and matrix instructions; with bfloat16 queries the
    products run in float16, to which float8 converts in one instruction a pair of entries
    (to bfloat16: two more, one an entry)."""
    rows, max_pages, hq, hkv, d = 32, 512, 32, 8, 128
    cache = jnp.ones((rows * max_pages + 1, 16, hkv, d), FP8)
    compiled = _paged_helpers.hopper_launch(
        cache,
        tokens=rows,
        hq=hq,
        rows=rows,
        max_pages=max_pages,
        query_start_loc=jnp.arange(rows + 1, dtype=jnp.int32),
        k_scale=jnp.ones((hkv,), jnp.float32),
        v_scale=0.5,
        decode=True,
    )
    _paged_helpers.assert_pipelined_matrix_code(compiled)
    cvt = collections.Counter(re.findall(r"\bcvt(?:\.\w+)+", compiled.ptx))
    assert cvt["cvt.rn.f16x2.e4m3x2"] > 0 and cvt["cvt.bf16.f16"] == 0, cvt
    assert re.search(r"\bmma\.sync\.aligned\.[\w.]*\.f32\.f16\.f16\.f32\b", compiled.ptx)


def test_fp8_v_tiles_as_words_reach_the_product_by_matrix_fragments(hopper_compile: None) -> None:
    """A float8 V tile loaded as float8 reaches P·V one byte at a time (``ld.shared.b8``: the
    transposed operand has no 8-bit ``ldmatrix``); as 32-bit words widened in registers it
    goes by ``ldmatrix.trans``, and every K/V copy is 16 bytes."""
    from ejkernel_triton import _codegen

    mix = _codegen.shared_memory_mix(_codegen.compile_launch(_codegen.decode_launches(FP8)).ptx)
    assert mix.get("ld.shared.b8", 0) > 0  # the default path, as measured
    words = _codegen.decode_launches(FP8, fp8_v_words=True)
    assert words.constexprs["V_WORDS"]
    compiled = _codegen.compile_launch(words)
    mix = _codegen.shared_memory_mix(compiled.ptx)
    assert "ld.shared.b8" not in mix and mix["ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"] > 0
    copies = _codegen.instruction_mix(compiled.ptx)
    assert {k for k in copies if k.startswith("cp.async")} == {"cp.async.cg.shared.global"}


# -- GPU --------------------------------------------------------------------------------------


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.gpu
def test_gpu_v3_update_in_place() -> None:
    """With the caches donated the compiled step aliases both caches to its outputs (their
    bytes are not allocated twice) and matches XLA's; 16 decodes + a chunk of 256, bf16."""
    rng = np.random.default_rng(0)
    kv_lens = [int(n) for n in rng.integers(256, 2049, 17)]
    page, hkv, hq, d = 16, 8, 32, 128
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = sum(-(-n // page) for n in kv_lens) + 8
    tables = paged_block_tables(
        rng, kv_lens, num_pages=num_pages, page_size=page, max_pages=max_pages
    )
    q_lens = [1] * 16 + [256]
    t = sum(q_lens)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    cache = (num_pages, page, hkv, d)
    args = (
        jax.random.normal(keys[0], (t, hq, d), jnp.bfloat16),
        jax.random.normal(keys[1], (t, hkv, d), jnp.bfloat16),
        jax.random.normal(keys[2], (t, hkv, d), jnp.bfloat16),
        jax.random.normal(keys[3], cache, jnp.bfloat16),
        jax.random.normal(keys[4], cache, jnp.bfloat16),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        jnp.asarray(17, jnp.int32),
    )

    def step(platform: str) -> Any:
        return jax.jit(
            lambda *xs: ejkernel.ragged_page_attention_v3(*xs, platform=platform),
            donate_argnums=(3, 4),
        )

    compiled = step("triton").lower(*args).compile()
    cache_bytes = 2 * int(np.prod(cache)) * 2
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= cache_bytes, memory
    assert memory.temp_size_in_bytes < cache_bytes // 2, memory
    expected = step("xla")(*(jnp.copy(x) for x in args))
    out = step("triton")(*args)
    assert _rel(out[0], expected[0]) < 1e-2
    for ours, theirs in zip(out[1:], expected[1:], strict=True):
        assert bool(jnp.all(ours == theirs))


def _heuristic(q: Any, kc: Any, vc: Any, lens: Any, tables: Any) -> Any:
    """The Triton page attention's heuristic config for these arguments."""
    from ejkernel_triton.ops import page_attention

    kwargs = {"query": q, "key_cache": kc, "value_cache": vc, "kv_lens": lens}
    return page_attention.heuristic(
        types.SimpleNamespace(kwargs={**kwargs, "block_tables": tables})
    )


@pytest.mark.gpu
def test_gpu_fp8_and_ragged_decode_serving_shapes() -> None:
    """fp8 page attention (B 32, 8k, per-head scales) and the dense ragged decode (B 32, 8k),
    against XLA."""
    b, sk, hq, hkv, d, page = 32, 8192, 32, 8, 128, 16
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(keys[0], (b, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, sk, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, sk, hkv, d), jnp.bfloat16)
    start = jax.random.randint(keys[3], (b,), 0, 1024)
    end = jnp.full((b,), sk, jnp.int32) - start
    run = jax.jit(
        lambda *xs, p: ejkernel.ragged_decode_attention(*xs, platform=p), static_argnames="p"
    )
    assert _rel(run(q, k, v, start, end, p="triton"), run(q, k, v, start, end, p="xla")) < 1e-2
    scale = jnp.linspace(0.5, 1.5, hkv, dtype=jnp.float32)
    kc = (k.reshape(-1, page, hkv, d) / scale[:, None]).astype(FP8)
    vc = (v.reshape(-1, page, hkv, d) / scale[:, None]).astype(FP8)
    tables = jnp.arange(b * sk // page, dtype=jnp.int32).reshape(b, -1)
    lens = jnp.full((b,), sk, jnp.int32)
    paged = jax.jit(
        lambda *xs, p: ejkernel.page_attention(*xs, k_scale=scale, v_scale=scale, platform=p),
        static_argnames="p",
    )
    ours, ref = paged(q, kc, vc, lens, tables, p="triton"), paged(q, kc, vc, lens, tables, p="xla")
    assert bool(jnp.all(jnp.isfinite(ours)))
    assert _rel(ours, ref) < 1e-2
    assert _heuristic(q, kc, vc, lens, tables).fp8_v_words
    byte_loads = attrs.evolve(_heuristic(q, kc, vc, lens, tables), fp8_v_words=False)
    run = jax.jit(
        lambda *xs: ejkernel.page_attention(
            *xs, k_scale=scale, v_scale=scale, platform="triton", cfg=byte_loads
        )
    )
    ours = run(q, kc, vc, lens, tables)
    assert bool(jnp.all(jnp.isfinite(ours))) and _rel(ours, ref) < 1e-2
