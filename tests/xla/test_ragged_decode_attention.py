"""The XLA ragged decode (one query per row over ``[start, end)`` of a dense cache) against the
reference. Every cache entry outside a row's valid range is NaN, so reading it fails loudly."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel.plugins import FwdParams
from ejkernel.specs.ragged_decode_attention import SPEC
from ejkernel.testing import Example, assert_close
from ejkernel.testing.cases.ragged_decode_attention import rows_example
from ejkernel_xla.ops.ragged_decode_attention import (
    RaggedDecodeAttentionConfig,
    config_space,
    heuristic,
    ragged_decode_attention_xla,
)

reference = SPEC.reference

#: The whole cache, a middle range, an empty range, one token at either end, a range ending
#: one short of the cache; D ≠ Dv.
GQA = rows_example((0, 5, 10, 36, 0, 3), (37, 20, 10, 37, 1, 36), sk=37, hq=6, hkv=2, d=40, dv=24)
#: MQA; ranges past the cache on either side are clamped to [0, Sk].
MQA = rows_example((0, 64, -5), (129, 100, 300), sk=129, hq=4, hkv=1, d=32)

#: 8-key blocks, three a step: Sk = 37 is no multiple of 8, so the last block is shifted left
#: and its overlap masked.
SMALL = RaggedDecodeAttentionConfig(fwd_params=FwdParams(kv_blocksize=8), blocks_per_step=3)


def make_inputs(rows: Example, dtype: str = "float32") -> dict[str, Any]:
    """Query and cache from the shared cases (NaN outside every row's valid range)."""
    return rows.build(SPEC, dtype)


def check(rows: Example, cfg: Any = None, dtype: str = "float32", **options: Any) -> jax.Array:
    args = helpers.validated(SPEC, make_inputs(rows, dtype), **options)
    out = ragged_decode_attention_xla(**args, cfg=cfg)
    b, hq = args["query"].shape[:2]
    helpers.assert_output(
        out, reference(**args), (b, hq, args["value"].shape[-1]), dtype, str(rows)
    )
    return out


@pytest.mark.parametrize("rows", [GQA, MQA], ids=str)
def test_output_matches_the_reference_for_every_batch(rows: Example) -> None:
    out = np.asarray(check(rows))
    args = make_inputs(rows)
    empty = np.asarray(args["sequence_end"]) <= np.asarray(args["sequence_start"])
    assert np.all(out[empty] == 0.0) and np.all(np.any(out[~empty] != 0.0, axis=(1, 2)))


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 3, "logits_soft_cap": 2.0, "softmax_scale": 0.4},
        {"softmax_aux": "Hq"},
        {"softmax_aux": "Hq-2", "sliding_window": (10, 10)},
        {"cfg": SMALL, "sliding_window": (13, 0), "logits_soft_cap": 4.0},
    ],
    ids=["window-3-softcap-scale", "sinks-Hq", "sinks-Hq-2-window", "small-blocks-shifted"],
)
def test_every_option_and_small_blocks_match_the_reference(options: dict[str, Any]) -> None:
    options = dict(options)
    if "softmax_aux" in options:
        options["softmax_aux"] = helpers.sinks(GQA.arrays["query"][0][1], options["softmax_aux"], 3)
    check(GQA, **options)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(MQA, dtype="bfloat16")


def test_jit_and_vmap_match_the_reference() -> None:
    arrays = make_inputs(GQA)
    stacked = {k: jnp.stack([v, v]) for k, v in arrays.items()}
    stacked["query"] = stacked["query"].at[1].multiply(-1.0)
    shorter = jnp.maximum(
        arrays["sequence_end"] - 2, arrays["sequence_start"]
    )  # still inside the valid range
    stacked["sequence_end"] = stacked["sequence_end"].at[1].set(shorter)

    @jax.jit
    def run(a: dict[str, Any]) -> jax.Array:
        return jax.vmap(lambda a: ejkernel.ragged_decode_attention(**a, sliding_window=(20, 0)))(a)

    out = run(stacked)
    for i in range(2):
        example = {k: v[i] for k, v in stacked.items()}
        assert_close(out[i], reference(**example, sliding_window=(20, 0)), name=f"example {i}")


def test_public_function_and_explain() -> None:
    args = tuple(make_inputs(MQA).values())
    out = helpers.explained_public_call(SPEC, args, RaggedDecodeAttentionConfig)
    assert_close(out, reference(*args))


def test_memory_does_not_grow_with_the_cache_length() -> None:
    def shapes(sk: int) -> dict[str, Any]:
        b = 8
        return {
            "query": jax.ShapeDtypeStruct((b, 8, 64), jnp.float32),
            "key": jax.ShapeDtypeStruct((b, sk, 2, 64), jnp.float32),
            "value": jax.ShapeDtypeStruct((b, sk, 2, 64), jnp.float32),
            "sequence_start": jax.ShapeDtypeStruct((b,), jnp.int32),
            "sequence_end": jax.ShapeDtypeStruct((b,), jnp.int32),
        }

    small, large = (
        helpers.temp_bytes(ragged_decode_attention_xla, shapes(sk)) for sk in (4096, 262_144)
    )
    assert small == large and small < 8 * 4096 * 2 * 64 * 4


@pytest.mark.parametrize("rows", [GQA, MQA], ids=str)
def test_configs_never_use_blocks_longer_than_the_cache(rows: Example) -> None:
    args = helpers.validated(SPEC, make_inputs(rows))
    sk = args["key"].shape[1]
    space = helpers.config_space_of(SPEC, args, heuristic, config_space)
    for cfg in space:
        assert cfg.fwd_params.q_blocksize == 1 and 1 <= cfg.fwd_params.kv_blocksize <= sk


def test_synthetic_inputs_are_valid() -> None:
    inputs = helpers.synthetic(SPEC, make_inputs(MQA), seed=1)
    start, end = np.asarray(inputs["sequence_start"]), np.asarray(inputs["sequence_end"])
    assert np.all((start >= 0) & (start < end) & (end <= inputs["key"].shape[1]))
    assert_close(ragged_decode_attention_xla(**inputs), reference(**inputs))


test_bad_inputs_raise_clear_errors_before_any_kernel = helpers.rejects_bad_inputs(
    SPEC,
    lambda: make_inputs(GQA),
    [
        ("query", jnp.ones((6, 6)), r"`query` must be \[B, Hq, D\]"),
        ("query", jnp.ones((6, 5, 40)), r"`key` must be \[B, Sk, Hkv, D\] with Hq % Hkv == 0"),
        (
            "query",
            jnp.ones((6, 6, 40), jnp.bfloat16),
            r"`query`, `key` and `value` must share one dtype",
        ),
        ("key", jnp.ones((5, 37, 2, 40)), r"`key` must be \[B, Sk, Hkv, D\] with Hq % Hkv == 0"),
        ("value", jnp.ones((6, 36, 2, 24)), r"`value` must be \[B, Sk, Hkv, Dv\]"),
        ("value", jnp.ones((6, 37, 2, 24), jnp.int32), r"`value` must be a floating array"),
        ("sequence_start", jnp.ones((5,), jnp.int32), r"`sequence_start` must be \[B\]=\(6,\)"),
        ("sequence_end", jnp.ones((6,)), r"`sequence_end` must be an integer"),
        (
            "softmax_aux",
            jnp.ones((4,)),
            r"`softmax_aux` must be floating \[Hq\] or \[Hq, n\] with Hq=6",
        ),
        ("logits_soft_cap", "big", r"`logits_soft_cap` must be a number"),
    ],
)
