"""The XLA chunked prefill (one sequence over its pages) against the reference.

Pages come in shuffled order, ``page_indices`` past the live pages hold garbage ids
(``10**6``, ``-1``), and every cache slot the sequence does not hold is NaN.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel._params import FwdParams
from ejkernel.specs._paged import paged_block_tables
from ejkernel.specs.prefill_page_attention import SPEC, prefill_page_attention_reference
from ejkernel.testing import assert_close
from ejkernel_xla.ops.prefill_page_attention import (
    PrefillPageAttentionConfig,
    config_space,
    heuristic,
    prefill_page_attention_xla,
    supports,
)

GARBAGE = (10**6, -1)
STATICS = ("softmax_scale", "logits_soft_cap", "sliding_window")
#: The oracle, jitted (eager, its many small ops would each compile on first use).
reference = jax.jit(prefill_page_attention_reference, static_argnames=STATICS)


@attrs.frozen(kw_only=True)
class Chunk:
    """The last ``c`` of ``kv_len`` tokens of one sequence of ``pages`` pages."""

    c: int
    kv_len: int
    hq: int
    hkv: int
    d: int
    page_size: int
    pages: int
    num_pages: int

    def __str__(self) -> str:
        return f"C{self.c}-kv{self.kv_len}-Hq{self.hq}-Hkv{self.hkv}-D{self.d}-page{self.page_size}x{self.pages}"


CHUNKED = Chunk(c=13, kv_len=40, hq=6, hkv=2, d=40, page_size=4, pages=12, num_pages=30)
FULL = Chunk(c=29, kv_len=29, hq=4, hkv=1, d=32, page_size=8, pages=5, num_pages=9)
ONE = Chunk(c=1, kv_len=48, hq=6, hkv=2, d=40, page_size=4, pages=12, num_pages=30)
#: More queries than keys: the first 4 queries sit at negative positions and see nothing.
BLIND = Chunk(c=10, kv_len=6, hq=6, hkv=2, d=40, page_size=4, pages=12, num_pages=30)
EMPTY = Chunk(c=3, kv_len=0, hq=6, hkv=2, d=40, page_size=4, pages=12, num_pages=30)


def make_inputs(
    chunk: Chunk, dtype: Any = jnp.float32, seed: int = 0, unused: Any = GARBAGE
) -> dict[str, Any]:
    """Query and caches (NaN in every slot the sequence does not hold) from a fixed seed."""
    rng = np.random.default_rng(seed)
    pages = paged_block_tables(
        rng,
        [chunk.kv_len],
        num_pages=chunk.num_pages,
        page_size=chunk.page_size,
        max_pages=chunk.pages,
        unused=unused,
    )[0]
    shape = (chunk.num_pages, chunk.page_size, chunk.hkv, chunk.d)
    owned = np.zeros(shape[:2], bool)
    for pos in range(chunk.kv_len):
        owned[pages[pos // chunk.page_size], pos % chunk.page_size] = True
    caches = rng.standard_normal((2, *shape), np.float32)
    caches[:, ~owned] = np.nan
    return {
        "query": jnp.asarray(rng.standard_normal((chunk.c, chunk.hq, chunk.d), np.float32), dtype),
        "key_cache": jnp.asarray(caches[0], dtype),
        "value_cache": jnp.asarray(caches[1], dtype),
        "kv_len": chunk.kv_len,
        "page_indices": jnp.asarray(pages),
    }


def validated(arrays: dict[str, Any], **options: Any) -> dict[str, Any]:
    return SPEC.validate(SPEC.bind((), {**arrays, **options}))


def check(chunk: Chunk, cfg: Any = None, dtype: Any = jnp.float32, **options: Any) -> jax.Array:
    args = validated(make_inputs(chunk, dtype), **options)
    out = prefill_page_attention_xla(**args, cfg=cfg)
    assert out.shape == args["query"].shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "garbage leaked into the output"
    assert_close(out, reference(**args), name=str(chunk))
    return out


@pytest.mark.parametrize("chunk", [CHUNKED, FULL, ONE], ids=str)
def test_output_matches_the_reference_for_every_chunk(chunk: Chunk) -> None:
    check(chunk)


@pytest.mark.parametrize("chunk", [BLIND, EMPTY], ids=str)
def test_queries_before_every_key_are_zeros(chunk: Chunk) -> None:
    out = np.asarray(check(chunk))
    blind = chunk.c - chunk.kv_len
    assert np.all(out[:blind] == 0.0) and np.all(np.any(out[blind:] != 0.0, axis=-1))


@pytest.mark.parametrize(
    "kv_len",
    [40, np.int64(40), jnp.int32(40), jnp.array([40], jnp.int16)],
    ids=["int", "numpy-int", "array-()", "array-(1,)-int16"],
)
def test_kv_len_may_be_an_int_or_a_scalar_array(kv_len: Any) -> None:
    arrays = {**make_inputs(CHUNKED), "kv_len": kv_len}
    out = prefill_page_attention_xla(**validated(arrays))
    assert_close(out, reference(**validated(make_inputs(CHUNKED))))


@pytest.mark.parametrize(
    "options",
    [{"sliding_window": (5, 0)}, {"logits_soft_cap": 2.0, "softmax_scale": 0.2}],
    ids=["window-5-0", "softcap-scale"],
)
def test_every_option_matches_the_reference(options: dict[str, Any]) -> None:
    check(CHUNKED, **options)


def test_small_blocks_match_the_reference() -> None:
    cfg = PrefillPageAttentionConfig(
        fwd_params=FwdParams(q_blocksize=4, kv_blocksize=8), blocks_per_step=3
    )
    check(CHUNKED, cfg, sliding_window=(9, 3), logits_soft_cap=5.0)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(FULL, dtype=jnp.bfloat16)


def test_garbage_page_ids_change_nothing() -> None:
    outs = [
        np.asarray(prefill_page_attention_xla(**validated(make_inputs(CHUNKED, unused=u))))
        for u in (0, GARBAGE)
    ]
    assert np.array_equal(outs[0], outs[1])


def test_jit_with_a_traced_kv_len_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(CHUNKED)
    cache = (arrays["key_cache"], arrays["value_cache"])
    queries = jnp.stack([arrays["query"], -arrays["query"]])
    lens = jnp.array([40, 17], jnp.int32)

    @jax.jit
    def run(q: jax.Array, kv_len: jax.Array) -> jax.Array:
        call = lambda q, n: ejkernel.prefill_page_attention(q, *cache, n, arrays["page_indices"])
        return jax.vmap(call)(q, kv_len)

    out = run(queries, lens)
    for i in range(2):
        assert_close(
            out[i],
            reference(queries[i], *cache, lens[i], arrays["page_indices"]),
            name=f"example {i}",
        )


def test_public_function_and_explain() -> None:
    args = tuple(make_inputs(FULL).values())
    record = ejkernel.explain("prefill_page_attention", *args)
    assert record.platform == "xla" and record.source == "heuristic"
    assert isinstance(record.config, PrefillPageAttentionConfig)
    assert_close(ejkernel.prefill_page_attention(*args), reference(*args))


class _Invocation:
    def __init__(self, chunk: Chunk) -> None:
        args = validated(make_inputs(chunk))
        self.kwargs = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v
            for k, v in args.items()
        }
        self.metadata = {"grad": False}


@pytest.mark.parametrize("chunk", [CHUNKED, ONE], ids=str)
def test_configs_use_whole_pages_and_the_heuristic_comes_first(chunk: Chunk) -> None:
    inv = _Invocation(chunk)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space)) and 1 <= len(space) <= 8
    for cfg in space:
        assert (
            cfg.fwd_params.kv_blocksize % chunk.page_size == 0
            and 1 <= cfg.fwd_params.q_blocksize <= chunk.c
        )
    assert supports(inv) is True


def test_synthetic_inputs_are_valid() -> None:
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v
        for k, v in validated(make_inputs(CHUNKED)).items()
    }
    inputs = SPEC.make_synthetic(abstract, seed=2)
    kv_len = int(inputs["kv_len"])
    assert CHUNKED.c <= kv_len <= CHUNKED.pages * CHUNKED.page_size
    live = np.asarray(inputs["page_indices"])[: -(-kv_len // CHUNKED.page_size)]
    assert np.all((live >= 0) & (live < CHUNKED.num_pages))
    assert_close(prefill_page_attention_xla(**inputs), reference(**inputs))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("query", jnp.ones((13, 6)), r"`query` must be \[C, Hq, D\]"),
        (
            "query",
            jnp.ones((13, 3, 40)),
            r"`query` must be \[C, Hq, D\] with D=40 and Hq % Hkv == 0",
        ),
        (
            "key_cache",
            jnp.ones((30, 4, 2, 40), jnp.bfloat16),
            r"`value_cache` must match `key_cache`",
        ),
        ("kv_len", 49, r"`kv_len` must be in \[0, 48\]"),
        ("kv_len", -1, r"`kv_len` must be in \[0, 48\]"),
        (
            "kv_len",
            jnp.array([1, 2], jnp.int32),
            r"`kv_len` must be an int or an integer array of shape \(\) or \(1,\)",
        ),
        ("kv_len", 4.0, r"`kv_len` must be an int or an integer array"),
        ("page_indices", jnp.ones((12,)), r"`page_indices` must be an integer"),
        ("page_indices", jnp.ones((3, 4), jnp.int32), r"`page_indices` must be \[P\]"),
        ("page_indices", jnp.ones((0,), jnp.int32), r"`page_indices` must be \[P\] with P >= 1"),
        ("sliding_window", -3, r"`sliding_window` must be non-negative"),
    ],
    ids=lambda x: x if isinstance(x, str) and not x.startswith("`") else None,
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    name: str, value: Any, message: str
) -> None:
    arrays = {**make_inputs(CHUNKED), name: value}
    with pytest.raises((TypeError, ValueError), match=r"^prefill_page_attention: " + message):
        ejkernel.prefill_page_attention(**arrays)
