"""The XLA unified attention (vLLM-style) against the reference: ALiBi, causal or not, sinks.

Batches are the shared hostile ones of the paged tests (shuffled pages, garbage table ids, NaN
in unowned cache slots), here with a prefix shared by two sequences.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel._params import FwdParams
from ejkernel.specs.unified_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel_xla.ops.unified_attention import (
    UnifiedAttentionConfig,
    config_space,
    heuristic,
    unified_attention_xla,
)

reference = SPEC.reference

#: The shared ragged batch (lengths 0 and 1, whole pages, chunked and full prefills, decode, more
#: queries than keys, a 2-page prefix shared by sequences 0 and 3) without padding tokens.
MIXED = attrs.evolve(helpers.MIXED, pad_tokens=0)
MQA = helpers.mqa_batch((129, 1, 16), (3, 1, 16), num_pages=20)


def make_inputs(batch: PagedBatch, dtype: str = "float32", unused: Any = GARBAGE) -> dict[str, Any]:
    """The batch's arguments from the shared cases (hostile tables, NaN in unowned slots)."""
    return batch.example(unused=unused).build(SPEC, dtype)


def check(batch: PagedBatch, cfg: Any = None, dtype: str = "float32", **options: Any) -> jax.Array:
    args = helpers.validated(SPEC, make_inputs(batch, dtype), **options)
    out = unified_attention_xla(**args, cfg=cfg)
    helpers.assert_output(out, reference(**args), args["queries"].shape, dtype, str(batch))
    return out


def slopes(hq: int) -> jax.Array:
    """ALiBi's geometric slopes (Press et al., 2022): 2^(-8 i / Hq)."""
    return jnp.asarray(2.0 ** (-8.0 * np.arange(1, hq + 1) / hq), jnp.float32)


@pytest.mark.parametrize("batch", [MIXED, MQA], ids=str)
def test_output_matches_the_reference_for_every_batch(batch: PagedBatch) -> None:
    out = np.asarray(check(batch))
    blind = sum(MIXED.q_lens[:6]) + np.arange(2)  # sequence 6: 4 queries, 2 keys
    if batch is MIXED:
        assert np.all(out[blind] == 0.0)


@pytest.mark.parametrize(
    "options",
    [
        {"causal": False, "sliding_window": (3, 2), "alibi_slopes": "alibi"},
        {"softmax_aux": "Hq", "alibi_slopes": "alibi"},
        {
            "sliding_window": (6, 0),
            "logits_soft_cap": 2.5,
            "softmax_scale": 0.3,
            "softmax_aux": "Hq-2",
        },
    ],
    ids=["non-causal-window-3-2-alibi", "sinks-Hq-alibi", "window-softcap-scale-sinks-Hq-2"],
)
def test_every_option_matches_the_reference(options: dict[str, Any]) -> None:
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = slopes(MIXED.hq)
    if "softmax_aux" in options:
        options["softmax_aux"] = helpers.sinks(MIXED.hq, options["softmax_aux"], 5)
    check(MIXED, **options)


def test_non_causal_queries_see_their_whole_sequence() -> None:
    # Sequence 6 has more queries (4) than keys (2): without causality every query sees both.
    out = np.asarray(check(MIXED, causal=False))
    assert np.all(np.any(out[sum(MIXED.q_lens[:6]) :] != 0.0, axis=-1))


def test_small_blocks_match_the_reference() -> None:
    cfg = UnifiedAttentionConfig(
        fwd_params=FwdParams(q_blocksize=3, kv_blocksize=4), blocks_per_step=4
    )
    check(MIXED, cfg, causal=False, sliding_window=(7, 5), alibi_slopes=slopes(MIXED.hq))


def test_bfloat16_matches_the_float32_reference() -> None:
    check(MQA, dtype="bfloat16", alibi_slopes=slopes(MQA.hq))


def test_garbage_in_unused_table_slots_changes_nothing() -> None:
    helpers.assert_unused_slots_change_nothing(unified_attention_xla, SPEC, make_inputs, MQA)


def test_jit_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(MIXED)
    rest = [v for k, v in arrays.items() if k != "queries"]
    queries = jnp.stack([arrays["queries"], 0.5 * arrays["queries"]])
    alibi = jnp.stack([slopes(MIXED.hq), -slopes(MIXED.hq)])

    @jax.jit
    def run(q: jax.Array, a: jax.Array) -> jax.Array:
        return jax.vmap(lambda q, a: ejkernel.unified_attention(q, *rest, alibi_slopes=a))(q, a)

    out = run(queries, alibi)
    for i in range(2):
        assert_close(
            out[i], reference(queries[i], *rest, alibi_slopes=alibi[i]), name=f"example {i}"
        )


def test_public_function_and_explain() -> None:
    args = tuple(make_inputs(MQA).values())
    out = helpers.explained_public_call(SPEC, args, UnifiedAttentionConfig, causal=False)
    assert_close(out, reference(*args, causal=False))


def test_configs_use_whole_pages_and_the_heuristic_comes_first() -> None:
    args = helpers.validated(SPEC, make_inputs(MIXED))
    space = helpers.config_space_of(SPEC, args, heuristic, config_space)
    assert all(cfg.fwd_params.kv_blocksize % MIXED.page_size == 0 for cfg in space)


def test_synthetic_inputs_are_valid() -> None:
    inputs = helpers.synthetic(SPEC, make_inputs(MQA), seed=4)
    qsl, kv_lens = np.asarray(inputs["query_start_loc"]), np.asarray(inputs["kv_lens"])
    assert qsl[0] == 0 and np.all(np.diff(qsl) >= 0) and np.all(np.diff(qsl) <= kv_lens)
    assert_close(unified_attention_xla(**inputs), reference(**inputs))


test_bad_inputs_raise_clear_errors_before_any_kernel = helpers.rejects_bad_inputs(
    SPEC,
    lambda: make_inputs(MIXED),
    [
        ("alibi_slopes", jnp.ones((5,)), r"`alibi_slopes` must be floating \[Hq\] with Hq=6"),
        ("alibi_slopes", jnp.ones((6,), jnp.int32), r"`alibi_slopes` must be floating \[Hq\]"),
        ("alibi_slopes", jnp.ones((6, 1)), r"`alibi_slopes` must be \[Hq\]"),
        ("causal", 1, r"`causal` must be a bool"),
        ("softmax_aux", jnp.ones((2, 6)), r"`softmax_aux` must be floating \[Hq\] or \[Hq, n\]"),
        (
            "queries",
            jnp.ones((38, 6, 40), jnp.bfloat16),
            r"`queries` and the key/value cache must share one dtype",
        ),
        (
            "query_start_loc",
            jnp.ones((7,), jnp.int32),
            r"`query_start_loc` must be \[num_seqs \+ 1\]=\(8,\)",
        ),
        (
            "kv_lens",
            jnp.ones((0,), jnp.int32),
            r"`kv_lens` must be \[num_seqs\] with num_seqs >= 1",
        ),
    ],
)
