"""The XLA ragged paged attention against the reference: ragged batches, options, hostile tables.

Every batch is built to be hostile: pages in shuffled order, table slots past the live pages
holding garbage ids (``10**6``, ``-1``), cache slots no sequence owns filled with NaN, so an
implementation that reads what it must not fails loudly.
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
from ejkernel.specs.ragged_page_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel_xla.ops.ragged_page_attention import (
    RaggedPageAttentionConfig,
    config_space,
    heuristic,
    ragged_page_attention_xla,
)

reference = SPEC.reference

MIXED = helpers.MIXED
#: MQA, large pages, a sequence filling its capacity exactly (144 = 9 × 16).
MQA = helpers.mqa_batch((129, 1, 16, 144), (3, 1, 16, 7), num_pages=40)
#: Pure decode (one query per sequence).
DECODE = PagedBatch(
    kv_lens=(17, 64, 3, 33),
    q_lens=(1, 1, 1, 1),
    hq=8,
    hkv=2,
    d=64,
    page_size=8,
    max_pages=8,
    num_pages=24,
)


def make_inputs(batch: PagedBatch, dtype: str = "float32", unused: Any = GARBAGE) -> dict[str, Any]:
    """The batch's arguments from the shared cases (hostile tables, NaN in unowned slots)."""
    args = batch.example(unused=unused).build(SPEC, dtype)
    return {k: v for k, v in args.items() if k != "num_seqs"}


def check(
    batch: PagedBatch,
    cfg: Any = None,
    dtype: str = "float32",
    num_seqs: Any = None,
    **options: Any,
) -> tuple[jax.Array, dict[str, Any]]:
    """Compare the XLA output with the reference; return ours and the arguments."""
    arrays = make_inputs(batch, dtype)
    args = helpers.validated(
        SPEC, arrays, num_seqs=len(batch.kv_lens) if num_seqs is None else num_seqs, **options
    )
    out = ragged_page_attention_xla(**args, cfg=cfg)
    ref = reference(**args)
    assert out.shape == arrays["queries"].shape and out.dtype == jnp.dtype(dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "garbage leaked into the output"
    assert_close(out, ref, name=str(batch))
    return out, args


SMALL = RaggedPageAttentionConfig(
    fwd_params=FwdParams(q_blocksize=3, kv_blocksize=4), blocks_per_step=5
)


@pytest.mark.parametrize("batch", [MQA, DECODE], ids=str)
def test_output_matches_the_reference_for_every_batch(batch: PagedBatch) -> None:
    check(batch)


def test_rows_that_see_no_key_and_padding_tokens_are_zeros() -> None:
    out, _ = check(MIXED)
    out = np.asarray(out)
    starts = np.concatenate([[0], np.cumsum(MIXED.q_lens)])
    blind_rows = starts[6] + np.arange(2)  # sequence 6: 4 queries, 2 keys
    padding = np.arange(MIXED.tokens - MIXED.pad_tokens, MIXED.tokens)
    assert np.all(out[blind_rows] == 0.0) and np.all(out[padding] == 0.0)
    assert np.all(np.any(out[starts[6] + 2 : starts[7]] != 0.0, axis=-1))


@pytest.mark.parametrize("num_seqs", [4, "array-(1,)"])
def test_only_the_first_num_seqs_sequences_are_live(num_seqs: Any) -> None:
    value = jnp.array([4], jnp.int32) if num_seqs == "array-(1,)" else num_seqs
    out, _ = check(MIXED, num_seqs=value)
    dead = slice(int(np.sum(MIXED.q_lens[:4])), MIXED.tokens)
    assert np.all(np.asarray(out)[dead] == 0.0)


def test_garbage_in_unused_table_slots_changes_nothing() -> None:
    unused = (0, GARBAGE, (2**31 - 1, -(2**31)))
    helpers.assert_unused_slots_change_nothing(
        ragged_page_attention_xla, SPEC, make_inputs, MIXED, unused, num_seqs=len(MIXED.kv_lens)
    )


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 3, "logits_soft_cap": 2.5, "softmax_scale": 0.3},
        {"softmax_aux": "Hq-2", "sliding_window": (4, 2)},
    ],
    ids=["window-3-softcap-scale", "sinks-Hq-2-window"],
)
def test_every_option_matches_the_reference(options: dict[str, Any]) -> None:
    options = dict(options)
    if "softmax_aux" in options:
        shape = (MIXED.hq,) if options["softmax_aux"] == "Hq" else (MIXED.hq, 2)
        options["softmax_aux"] = normal(jax.random.PRNGKey(7), shape) + 1.0
    check(MIXED, **options)


def test_small_blocks_with_many_items_and_steps_match_the_reference() -> None:
    sinks = normal(jax.random.PRNGKey(8), (MIXED.hq,))
    check(MIXED, SMALL, sliding_window=(9, 0), softmax_aux=sinks, logits_soft_cap=4.0)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(MQA, dtype="bfloat16", sliding_window=(50, 0))


def test_jit_with_a_traced_num_seqs_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(MIXED)
    rest = {k: v for k, v in arrays.items() if k != "queries"}
    queries = jnp.stack([arrays["queries"], -0.5 * arrays["queries"]])
    live = jnp.array([7, 3], jnp.int32)

    @jax.jit
    def run(q: jax.Array, n: jax.Array) -> jax.Array:
        return jax.vmap(lambda q, n: ejkernel.ragged_page_attention(q, *rest.values(), n))(q, n)

    out = run(queries, live)
    for i in range(2):
        expected = reference(queries[i], *rest.values(), live[i])
        assert_close(out[i], expected, name=f"example {i}")


def test_public_function_and_explain() -> None:
    arrays = make_inputs(DECODE)
    args = (*arrays.values(), 3)
    out = helpers.explained_public_call(SPEC, args, RaggedPageAttentionConfig, logits_soft_cap=3.0)
    assert_close(out, reference(*args, logits_soft_cap=3.0))


def test_work_and_memory_do_not_grow_with_num_pages() -> None:
    def shapes(num_pages: int) -> dict[str, Any]:
        t, s, max_pages = 256, 16, 64
        return {
            "queries": jax.ShapeDtypeStruct((t, 8, 64), jnp.float32),
            **helpers.abstract_paged_cache(num_pages, s, max_pages),
            "query_start_loc": jax.ShapeDtypeStruct((s + 1,), jnp.int32),
            "num_seqs": jax.ShapeDtypeStruct((), jnp.int32),
        }

    small, large = (
        helpers.temp_bytes(ragged_page_attention_xla, shapes(n)) for n in (1024, 100_000)
    )
    cache_bytes = 1024 * 16 * 2 * 64 * 4
    assert small == large and small < cache_bytes


def test_synthetic_inputs_are_valid() -> None:
    inputs = helpers.synthetic(SPEC, make_inputs(MQA), seed=3, num_seqs=4)
    kv_lens, qsl = np.asarray(inputs["kv_lens"]), np.asarray(inputs["query_start_loc"])
    tables = np.asarray(inputs["block_tables"])
    assert qsl[0] == 0 and np.all(np.diff(qsl) >= 0) and qsl[-1] <= MQA.tokens
    assert np.all(np.diff(qsl) <= kv_lens) and np.all(kv_lens <= MQA.max_pages * MQA.page_size)
    for s, n in enumerate(kv_lens):
        live = tables[s, : -(-n // MQA.page_size)]
        assert np.all((live >= 0) & (live < MQA.num_pages))
    out = ragged_page_attention_xla(**inputs)
    assert_close(out, reference(**inputs))


@pytest.mark.parametrize(
    ("rows", "tokens", "q_lens"),
    [
        (16, 2060, [1] * 12 + [512] * 4),  # 12 decodes and 4 chunks
        (66, 4160, [1] * 58 + [513] * 6 + [512] * 2),
        (32, 32, [1] * 32),  # a decode batch
        (4, 2048, [512] * 4),  # chunks only
        (8, 5, [1] * 5 + [0] * 3),  # fewer tokens than rows
    ],
)
def test_synthetic_batches_look_like_a_serving_step(
    rows: int, tokens: int, q_lens: list[int]
) -> None:
    """What the tuner times: one query a sequence, the tokens past that in chunks of about
    512 queries on the last sequences."""
    from ejkernel.specs._paged import synthetic_paged_batch

    batch = synthetic_paged_batch(
        np.random.default_rng(0), num_seqs=rows, num_tokens=tokens, num_pages=rows * 256 + 3,
        page_size=16, max_pages=256,
    )  # fmt: skip
    assert np.diff(batch["query_start_loc"]).tolist() == q_lens
    assert np.all(batch["kv_lens"] >= q_lens)


@pytest.mark.parametrize("batch", [MIXED, MQA, DECODE], ids=str)
def test_configs_use_whole_pages_and_the_heuristic_comes_first(batch: PagedBatch) -> None:
    args = helpers.validated(SPEC, make_inputs(batch), num_seqs=len(batch.kv_lens))
    space = helpers.config_space_of(SPEC, args, heuristic, config_space)
    for cfg in space:
        assert cfg.fwd_params.kv_blocksize % batch.page_size == 0
        assert 1 <= cfg.fwd_params.q_blocksize <= batch.tokens and cfg.blocks_per_step >= 1


def _bad(name: str, value: Any) -> dict[str, Any]:
    return {name: value}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_bad("queries", jnp.ones((4, 6))), r"`queries` must be \[T, Hq, D\]"),
        (
            _bad("queries", jnp.ones((4, 5, 40))),
            r"`queries` must be \[T, Hq, D\] with D=40 and Hq % Hkv == 0",
        ),
        (_bad("queries", jnp.ones((4, 6, 8))), r"`queries` must be \[T, Hq, D\] with D=40"),
        (
            _bad("queries", jnp.ones((4, 6, 40), jnp.bfloat16)),
            r"`queries` and the key/value cache must share one dtype",
        ),
        (_bad("value_cache", jnp.ones((64, 4, 2, 8))), r"`value_cache` must match `key_cache`"),
        (
            _bad("key_cache", jnp.ones((64, 4, 2))),
            r"`key_cache` must be \[num_pages, page_size, Hkv, D\]",
        ),
        (_bad("kv_lens", jnp.ones((7,))), r"`kv_lens` must be an integer"),
        (_bad("kv_lens", jnp.ones((7, 1), jnp.int32)), r"`kv_lens` must be \[num_seqs\]"),
        (
            _bad("block_tables", jnp.ones((6, 11), jnp.int32)),
            r"`block_tables` must be \[num_seqs, max_pages\] with num_seqs=7",
        ),
        (_bad("block_tables", jnp.ones((7, 11))), r"`block_tables` must be an integer"),
        (
            _bad("query_start_loc", jnp.ones((7,), jnp.int32)),
            r"`query_start_loc` must be \[num_seqs \+ 1\]=\(8,\)",
        ),
        (_bad("num_seqs", 8), r"`num_seqs` must be in \[0, 7\]"),
        (
            _bad("num_seqs", jnp.ones((2,), jnp.int32)),
            r"`num_seqs` must be an int or an integer array of shape \(\) or \(1,\)",
        ),
        (_bad("num_seqs", jnp.float32(3)), r"`num_seqs` must be an int or an integer array"),
        (
            _bad("softmax_aux", jnp.ones((5,))),
            r"`softmax_aux` must be floating \[Hq\] or \[Hq, n\] with Hq=6",
        ),
        (_bad("logits_soft_cap", -1.0), r"`logits_soft_cap` must be > 0"),
        (_bad("sliding_window", (-1, 0)), r"`sliding_window` must be non-negative"),
    ],
    ids=lambda x: x if isinstance(x, str) else next(iter(x)),
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    change: dict[str, Any], message: str
) -> None:
    helpers.assert_rejected(SPEC, {**make_inputs(MIXED), "num_seqs": 7, **change}, message)
