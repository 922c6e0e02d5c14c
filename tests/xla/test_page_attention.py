"""The XLA page attention (one decode token per sequence) against the reference.

Batches are hostile: shuffled pages, garbage ids (``10**6``, ``-1``) in table slots past the
live pages, NaN in every cache slot no sequence holds, a prefix shared by two sequences.
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
from ejkernel.specs.page_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel_xla.ops.page_attention import (
    PageAttentionConfig,
    config_space,
    heuristic,
    page_attention_xla,
)

reference = SPEC.reference

#: Lengths 0 and 1, a whole page (5), whole capacity (45), odd lengths; sequences 0 and 4
#: share their first 3 pages.
GQA = PagedBatch(
    kv_lens=(37, 0, 1, 5, 45, 23),
    hq=6,
    hkv=2,
    d=40,
    page_size=5,
    max_pages=9,
    num_pages=48,
    shared_pages=3,
)
#: MQA, 16-token pages.
MQA = PagedBatch(
    kv_lens=(129, 16, 2, 64), hq=4, hkv=1, d=32, page_size=16, max_pages=10, num_pages=33
)

#: Blocks of two pages, three a step.
SMALL = PageAttentionConfig(fwd_params=FwdParams(kv_blocksize=10), blocks_per_step=3)


def make_inputs(batch: PagedBatch, dtype: str = "float32", unused: Any = GARBAGE) -> dict[str, Any]:
    """The batch's arguments from the shared cases (hostile tables, NaN in unowned slots)."""
    return batch.example("decode", unused=unused).build(SPEC, dtype)


def check(batch: PagedBatch, cfg: Any = None, dtype: str = "float32", **options: Any) -> jax.Array:
    arrays = make_inputs(batch, dtype)
    return helpers.check_call(
        page_attention_xla, SPEC, reference, arrays, cfg, dtype, str(batch), **options
    )


@pytest.mark.parametrize("batch", [GQA, MQA], ids=str)
def test_output_matches_the_reference_for_every_batch(batch: PagedBatch) -> None:
    out = check(batch)
    empty = np.asarray(batch.kv_lens) == 0
    assert np.all(np.asarray(out)[empty] == 0.0)


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 0},
        {"sliding_window": (7, 0), "logits_soft_cap": 2.0, "softmax_scale": 0.5},
        {"cfg": SMALL, "sliding_window": (12, 0), "logits_soft_cap": 3.0},
    ],
    ids=["window-0", "window-7-0-softcap-scale", "small-blocks-window-softcap"],
)
def test_every_option_and_small_blocks_match_the_reference(options: dict[str, Any]) -> None:
    check(GQA, **options)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(MQA, dtype="bfloat16")


def test_garbage_in_unused_table_slots_changes_nothing() -> None:
    helpers.assert_unused_slots_change_nothing(page_attention_xla, SPEC, make_inputs, GQA)


def test_jit_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(GQA)
    rest = {k: v for k, v in arrays.items() if k not in ("query", "kv_lens")}
    queries = jnp.stack([arrays["query"], 2.0 * arrays["query"]])
    lens = jnp.stack([arrays["kv_lens"], jnp.maximum(arrays["kv_lens"] - 3, 0)])

    @jax.jit
    def run(q: jax.Array, kv_lens: jax.Array) -> jax.Array:
        call = lambda q, n: ejkernel.page_attention(
            q, rest["key_cache"], rest["value_cache"], n, rest["block_tables"]
        )
        return jax.vmap(call)(q, kv_lens)

    out = run(queries, lens)
    for i in range(2):
        expected = reference(
            queries[i], rest["key_cache"], rest["value_cache"], lens[i], rest["block_tables"]
        )
        assert_close(out[i], expected, name=f"example {i}")


def test_public_function_and_explain() -> None:
    args = tuple(make_inputs(MQA).values())
    out = helpers.explained_public_call(SPEC, args, PageAttentionConfig, sliding_window=40)
    assert_close(out, reference(*args, sliding_window=(40, 40)))


def test_memory_does_not_grow_with_num_pages() -> None:
    def shapes(num_pages: int) -> dict[str, Any]:
        s, max_pages = 32, 64
        return {
            "query": jax.ShapeDtypeStruct((s, 8, 64), jnp.float32),
            **helpers.abstract_paged_cache(num_pages, s, max_pages),
        }

    small, large = (helpers.temp_bytes(page_attention_xla, shapes(n)) for n in (1024, 100_000))
    assert small == large and small < 1024 * 16 * 2 * 64 * 4


@pytest.mark.parametrize("batch", [GQA, MQA], ids=str)
def test_configs_use_one_token_items_and_whole_pages(batch: PagedBatch) -> None:
    space = helpers.config_space_of(
        SPEC, helpers.validated(SPEC, make_inputs(batch)), heuristic, config_space
    )
    for cfg in space:
        assert (
            cfg.fwd_params.q_blocksize == 1 and cfg.fwd_params.kv_blocksize % batch.page_size == 0
        )


def test_the_reference_is_one_program_per_set_of_static_arguments() -> None:
    """The paged references jit their body (arrays traced, everything else static): a second
    call with the same statics compiles nothing new, another window compiles once more, and an
    unhashable argument runs op by op to the same result."""
    from ejkernel.specs import _base
    from ejkernel.specs.page_attention import page_attention_reference

    first, second = make_inputs(GQA), make_inputs(MQA)
    page_attention_reference(**first, sliding_window=(3, 0))
    before = _base.jitted_with_statics.cache_info()
    page_attention_reference(**first, sliding_window=(3, 0))
    same = _base.jitted_with_statics.cache_info()
    page_attention_reference(**first, sliding_window=(5, 0))
    assert (same.hits, same.misses) == (before.hits + 1, before.misses)
    assert _base.jitted_with_statics.cache_info().misses == before.misses + 1
    jitted = page_attention_reference(**second, sliding_window=(3, 0))
    by_op = page_attention_reference(**second, sliding_window=[3, 0])
    assert np.isfinite(np.asarray(jitted)).all()
    assert_close(jitted, by_op)


def test_synthetic_inputs_are_valid() -> None:
    inputs = helpers.synthetic(SPEC, make_inputs(MQA), seed=1)
    kv_lens = np.asarray(inputs["kv_lens"])
    assert np.all((kv_lens >= 1) & (kv_lens <= MQA.max_pages * MQA.page_size))
    assert_close(page_attention_xla(**inputs), reference(**inputs))


test_bad_inputs_raise_clear_errors_before_any_kernel = helpers.rejects_bad_inputs(
    SPEC,
    lambda: make_inputs(GQA),
    [
        ("query", jnp.ones((6, 6)), r"`query` must be \[S, Hq, D\]"),
        (
            "query",
            jnp.ones((6, 5, 40)),
            r"`query` must be \[S, Hq, D\] with D=40 and Hq % Hkv == 0",
        ),
        (
            "query",
            jnp.ones((6, 6, 40), jnp.float16),
            r"`query` and the key/value cache must share one dtype",
        ),
        ("key_cache", jnp.ones((48, 5, 2, 40), jnp.int32), r"`key_cache` must be a floating array"),
        ("value_cache", jnp.ones((48, 5, 1, 40)), r"`value_cache` must match `key_cache`"),
        ("kv_lens", jnp.ones((5,), jnp.int32), r"`kv_lens` must be \[S\]=\(6,\)"),
        ("kv_lens", jnp.ones((6,)), r"`kv_lens` must be an integer"),
        (
            "block_tables",
            jnp.ones((6,), jnp.int32),
            r"`block_tables` must be \[num_seqs, max_pages\]",
        ),
        (
            "block_tables",
            jnp.ones((6, 0), jnp.int32),
            r"`block_tables` must be \[num_seqs, max_pages\] with num_seqs=6",
        ),
        ("logits_soft_cap", 0.0, r"`logits_soft_cap` must be > 0"),
        ("sliding_window", (1, 2, 3), r"`sliding_window` must be an int or \(left, right\)"),
    ],
)
