"""The XLA chunked prefill (one sequence over its pages) against the reference.

Pages come in shuffled order, ``page_indices`` past the live pages hold garbage ids
(``10**6``, ``-1``), and every cache slot the sequence does not hold is NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel._params import FwdParams
from ejkernel.specs.prefill_page_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel_xla.ops.prefill_page_attention import (
    PrefillPageAttentionConfig,
    config_space,
    heuristic,
    prefill_page_attention_xla,
)

reference = SPEC.reference


def chunk(c: int, kv_len: int, **sizes: int) -> PagedBatch:
    """The last ``c`` of ``kv_len`` tokens of one sequence (GQA, 4-token pages by default)."""
    paging = {"hq": 6, "hkv": 2, "d": 40, "page_size": 4, "max_pages": 12, "num_pages": 30}
    return PagedBatch(kv_lens=(kv_len,), q_lens=(c,), **{**paging, **sizes})


CHUNKED = chunk(13, 40)
FULL = chunk(29, 29, hq=4, hkv=1, d=32, page_size=8, max_pages=5, num_pages=9)
ONE = chunk(1, 48)
#: More queries than keys: the first 4 queries sit at negative positions and see nothing.
BLIND = chunk(10, 6)
EMPTY = chunk(3, 0)


def make_inputs(batch: PagedBatch, dtype: str = "float32", unused: Any = GARBAGE) -> dict[str, Any]:
    """Query and caches from the shared cases: NaN in every slot the sequence does not hold,
    garbage ids past its live pages."""
    return batch.example("prefill", unused=unused).build(SPEC, dtype)


def check(batch: PagedBatch, cfg: Any = None, dtype: str = "float32", **options: Any) -> jax.Array:
    arrays = make_inputs(batch, dtype)
    return helpers.check_call(
        prefill_page_attention_xla, SPEC, reference, arrays, cfg, dtype, str(batch), **options
    )


@pytest.mark.parametrize("batch", [CHUNKED, FULL, ONE], ids=str)
def test_output_matches_the_reference_for_every_chunk(batch: PagedBatch) -> None:
    check(batch)


@pytest.mark.parametrize("batch", [BLIND, EMPTY], ids=str)
def test_queries_before_every_key_are_zeros(batch: PagedBatch) -> None:
    out = np.asarray(check(batch))
    blind = batch.tokens - batch.kv_lens[0]
    assert np.all(out[:blind] == 0.0) and np.all(np.any(out[blind:] != 0.0, axis=-1))


@pytest.mark.parametrize(
    "kv_len",
    [40, np.int64(40), jnp.int32(40), jnp.array([40], jnp.int16)],
    ids=["int", "numpy-int", "array-()", "array-(1,)-int16"],
)
def test_kv_len_may_be_an_int_or_a_scalar_array(kv_len: Any) -> None:
    arrays = {**make_inputs(CHUNKED), "kv_len": kv_len}
    out = prefill_page_attention_xla(**helpers.validated(SPEC, arrays))
    assert_close(out, reference(**helpers.validated(SPEC, make_inputs(CHUNKED))))


def test_every_option_matches_the_reference() -> None:
    check(CHUNKED, sliding_window=(5, 0), logits_soft_cap=2.0, softmax_scale=0.2)


def test_small_blocks_match_the_reference() -> None:
    cfg = PrefillPageAttentionConfig(
        fwd_params=FwdParams(q_blocksize=4, kv_blocksize=8), blocks_per_step=3
    )
    check(CHUNKED, cfg, sliding_window=(9, 3), logits_soft_cap=5.0)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(FULL, dtype="bfloat16")


def test_garbage_page_ids_change_nothing() -> None:
    helpers.assert_unused_slots_change_nothing(
        prefill_page_attention_xla, SPEC, make_inputs, CHUNKED
    )


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
    out = helpers.explained_public_call(SPEC, args, PrefillPageAttentionConfig)
    assert_close(out, reference(*args))


@pytest.mark.parametrize("batch", [CHUNKED, ONE], ids=str)
def test_configs_use_whole_pages_and_the_heuristic_comes_first(batch: PagedBatch) -> None:
    args = helpers.validated(SPEC, make_inputs(batch))
    space = helpers.config_space_of(SPEC, args, heuristic, config_space)
    for cfg in space:
        assert (
            cfg.fwd_params.kv_blocksize % batch.page_size == 0
            and 1 <= cfg.fwd_params.q_blocksize <= batch.tokens
        )


def test_synthetic_inputs_are_valid() -> None:
    inputs = helpers.synthetic(SPEC, make_inputs(CHUNKED), seed=2)
    kv_len = int(inputs["kv_len"])
    assert CHUNKED.tokens <= kv_len <= CHUNKED.max_pages * CHUNKED.page_size
    live = np.asarray(inputs["page_indices"])[: -(-kv_len // CHUNKED.page_size)]
    assert np.all((live >= 0) & (live < CHUNKED.num_pages))
    assert_close(prefill_page_attention_xla(**inputs), reference(**inputs))


test_bad_inputs_raise_clear_errors_before_any_kernel = helpers.rejects_bad_inputs(
    SPEC,
    lambda: make_inputs(CHUNKED),
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
)
