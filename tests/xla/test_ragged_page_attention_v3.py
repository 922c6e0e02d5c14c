"""The XLA fused cache update + ragged paged attention against the reference, and donation.

Batches are hostile: shuffled pages, garbage ids (``10**6``, ``-1``) in table slots past the
live pages, NaN in every cache slot no sequence holds (the new tokens' slots included: the
update must fill them before the attention reads them), a read-only prefix shared by two
sequences.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel._params import FwdParams
from ejkernel.specs.ragged_page_attention_v3 import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import PagedBatch
from ejkernel_xla.ops.ragged_page_attention_v3 import (
    RaggedPageAttentionV3Config,
    config_space,
    heuristic,
    ragged_page_attention_v3_xla,
)

reference = SPEC.reference

#: Lengths 0 and 1, a whole-page prefill (8), chunked prefills, decode, a sequence with more
#: new tokens than positions (its 2 first tokens are neither written nor see anything),
#: padding tokens; sequence 3 reads sequence 0's first 2 pages and writes only past them.
MIXED = attrs.evolve(
    helpers.MIXED,
    kv_lens=(37, 0, 1, 12, 8, 19, 5, 2),
    q_lens=(5, 0, 1, 4, 8, 7, 1, 4),
    shared_pages=(0, 0, 0, 2, 0, 0, 0, 0),
)
MQA = helpers.mqa_batch((129, 1, 144), (3, 1, 16), num_pages=30)


def make_inputs(batch: PagedBatch, dtype: str = "float32") -> dict[str, Any]:
    """Queries, new keys/values and caches from the shared cases: NaN wherever no old token
    lies (the new tokens' slots included: the update must fill them before the attention
    reads them)."""
    args = batch.example(new_tokens=True).build(SPEC, dtype)
    return {k: v for k, v in args.items() if k != "num_seqs"}


def written_slots(batch: PagedBatch, tables: np.ndarray, num_seqs: int) -> set[tuple[int, int]]:
    """(page, slot) of every new token that must be written."""
    slots = set()
    for s in range(num_seqs):
        n, q = batch.kv_lens[s], batch.q_lens[s]
        for pos in range(max(n - q, 0), n):
            slots.add((int(tables[s, pos // batch.page_size]), pos % batch.page_size))
    return slots


def check(
    batch: PagedBatch,
    cfg: Any = None,
    dtype: str = "float32",
    num_seqs: int | None = None,
    **options: Any,
) -> tuple[Any, dict[str, Any]]:
    """Compare output and both caches with the reference; check exactly which slots changed."""
    num_seqs = len(batch.kv_lens) if num_seqs is None else num_seqs
    arrays = make_inputs(batch, dtype)
    args = helpers.validated(SPEC, arrays, num_seqs=num_seqs, **options)
    out, key_cache, value_cache = ragged_page_attention_v3_xla(**args, cfg=cfg)
    ref_out, ref_keys, ref_values = reference(**args)
    dtype = jnp.dtype(dtype)
    assert out.shape == arrays["queries"].shape and out.dtype == dtype and key_cache.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "garbage leaked into the output"
    assert_close(out, ref_out, name=str(batch))
    np.testing.assert_array_equal(
        np.asarray(key_cache, np.float32), np.asarray(ref_keys, np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(value_cache, np.float32), np.asarray(ref_values, np.float32)
    )
    old, new = np.asarray(arrays["key_cache"], np.float32), np.asarray(key_cache, np.float32)
    changed = ~((old == new) | (np.isnan(old) & np.isnan(new)))
    expected = np.zeros(changed.shape[:2], bool)
    for page, slot in written_slots(batch, np.asarray(arrays["block_tables"]), num_seqs):
        expected[page, slot] = True
    assert np.array_equal(changed.any(axis=(2, 3)), expected), "wrong cache slots written"
    return (out, key_cache, value_cache), args


def test_output_and_updated_caches_match_the_reference() -> None:
    check(MQA)


def test_blind_rows_padding_and_dead_sequences_are_zeros_and_unwritten() -> None:
    (out, _, _), _ = check(MIXED, num_seqs=6)
    out = np.asarray(out)
    assert np.all(out[sum(MIXED.q_lens[:6]) :] == 0.0)  # sequences 6 and 7, and padding
    (out, _, _), _ = check(MIXED)
    blind = sum(MIXED.q_lens[:7]) + np.arange(2)  # sequence 7: 4 new tokens, 2 positions
    assert np.all(out[blind] == 0.0)


def test_every_option_matches_the_reference() -> None:
    sinks = jnp.asarray(np.random.default_rng(6).standard_normal((MIXED.hq, 2)), jnp.float32)
    check(MIXED, sliding_window=(5, 0), logits_soft_cap=3.0, softmax_scale=0.25, softmax_aux=sinks)


def test_small_blocks_match_the_reference() -> None:
    cfg = RaggedPageAttentionV3Config(
        fwd_params=FwdParams(q_blocksize=2, kv_blocksize=8), blocks_per_step=3
    )
    check(MIXED, cfg, sliding_window=(10, 0))


def test_bfloat16_matches_the_float32_reference() -> None:
    check(MQA, dtype="bfloat16")


def test_donated_caches_are_updated_in_place_under_jit() -> None:
    arrays = make_inputs(MIXED)
    # Caches in buffers XLA owns: on CPU, jnp.asarray may adopt an aligned NumPy array without a
    # copy, and memory NumPy owns cannot be donated (XLA would then copy, correctly but not in
    # place).
    arrays.update(
        key_cache=jnp.copy(arrays["key_cache"]), value_cache=jnp.copy(arrays["value_cache"])
    )
    args = (*arrays.values(), 8)
    # Wait for the reference: a buffer still in use by a running computation cannot be donated.
    expected = jax.block_until_ready(reference(*args))
    step = jax.jit(ejkernel.ragged_page_attention_v3, donate_argnums=(3, 4))
    key_cache = arrays["key_cache"]
    pointer = key_cache.unsafe_buffer_pointer()
    out, new_keys, new_values = step(*args)
    assert key_cache.is_deleted() and arrays["value_cache"].is_deleted()
    assert new_keys.unsafe_buffer_pointer() == pointer, "the key cache was copied"
    assert_close(out, expected[0])
    np.testing.assert_array_equal(np.asarray(new_keys), np.asarray(expected[1]))
    np.testing.assert_array_equal(np.asarray(new_values), np.asarray(expected[2]))
    # Compiled for a large cache: both caches alias their outputs, and the temporaries are a
    # small fraction of one cache (nothing copies or gathers it whole).
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in make_inputs(MIXED).items()}
    cache = jax.ShapeDtypeStruct((20_000, *shapes["key_cache"].shape[1:]), jnp.float32)
    shapes.update(key_cache=cache, value_cache=cache)
    memory = step.lower(*shapes.values(), 8).compile().memory_analysis()
    if memory is not None:
        cache_bytes = cache.size * 4
        assert (
            memory.alias_size_in_bytes == 2 * cache_bytes
            and memory.temp_size_in_bytes < cache_bytes / 10
        )


def test_jit_with_a_traced_num_seqs_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(MIXED)
    new = ("queries", "keys", "values")
    stacked = {k: jnp.stack([arrays[k], -arrays[k]]) for k in new}
    rest = [v for k, v in arrays.items() if k not in new]
    live = jnp.array([8, 5], jnp.int32)

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array) -> Any:
        return jax.vmap(lambda q, k, v, n: ejkernel.ragged_page_attention_v3(q, k, v, *rest, n))(
            q, k, v, n
        )

    outs = run(*stacked.values(), live)
    for i in range(2):
        expected = reference(*(stacked[k][i] for k in new), *rest, live[i])
        assert_close(outs[0][i], expected[0], name=f"example {i}")
        np.testing.assert_array_equal(np.asarray(outs[1][i]), np.asarray(expected[1]))


def test_public_function_and_explain() -> None:
    args = (*make_inputs(MQA).values(), jnp.array([3], jnp.int32))
    out = helpers.explained_public_call(SPEC, args, RaggedPageAttentionV3Config)
    expected = reference(*args)
    assert isinstance(out, tuple) and len(out) == 3
    assert_close(out[0], expected[0])
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(expected[1]))


def test_configs_use_whole_pages_and_the_heuristic_comes_first() -> None:
    args = helpers.validated(SPEC, make_inputs(MIXED), num_seqs=len(MIXED.kv_lens))
    space = helpers.config_space_of(SPEC, args, heuristic, config_space)
    assert all(cfg.fwd_params.kv_blocksize % MIXED.page_size == 0 for cfg in space)


def test_synthetic_inputs_write_distinct_slots() -> None:
    inputs = helpers.synthetic(SPEC, make_inputs(MQA), seed=5, num_seqs=3)
    kv_lens, qsl = np.asarray(inputs["kv_lens"]), np.asarray(inputs["query_start_loc"])
    tables = np.asarray(inputs["block_tables"])
    slots = [
        (tables[s, pos // MQA.page_size], pos % MQA.page_size)
        for s in range(3)
        for pos in range(kv_lens[s] - (qsl[s + 1] - qsl[s]), kv_lens[s])
    ]
    assert len(slots) == len(set(slots)) == qsl[-1]
    ours, ref = ragged_page_attention_v3_xla(**inputs), reference(**inputs)
    assert_close(ours[0], ref[0])
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(ref[1]))


test_bad_inputs_raise_clear_errors_before_any_kernel = helpers.rejects_bad_inputs(
    SPEC,
    lambda: {**make_inputs(MIXED), "num_seqs": 8},
    [
        ("keys", jnp.ones((33, 2)), r"`keys` must be \[T, Hkv, D\]"),
        ("keys", jnp.ones((32, 2, 40)), r"`keys` must be \[T, Hkv, D\]=\(33, 2, 40\)"),
        ("values", jnp.ones((33, 1, 40)), r"`values` must be \[T, Hkv, D\]=\(33, 2, 40\)"),
        (
            "values",
            jnp.ones((33, 2, 40), jnp.bfloat16),
            r"`values` must share the cache dtype float32",
        ),
        ("num_seqs", 9, r"`num_seqs` must be in \[0, 8\]"),
        ("block_tables", jnp.ones((8, 11)), r"`block_tables` must be an integer"),
    ],
)
