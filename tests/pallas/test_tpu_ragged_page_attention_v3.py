"""The Pallas Mosaic-TPU ragged_page_attention_v3 (cache update kernel, then the ragged paged
attention kernel) in TPU interpret mode on the CPU, against the spec's reference: the output
and both updated caches.

The batches are the shared hostile ones with new tokens: their cache slots hold NaN until the
update writes them, pages come in shuffled order, table slots past the live pages hold
``10**6`` and ``-1``, and padding tokens belong to no sequence (they must write nothing).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas._paged_helpers import validated

import ejkernel
from ejkernel.ops import FwdParams, Invocation
from ejkernel.specs.ragged_page_attention_v3 import SPEC, cache_destinations
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import PagedBatch
from ejkernel.testing.cases.ragged_page_attention import MIXED, MQA
from ejkernel_pallas.tpu.ragged_page_attention_v3 import (
    RaggedPageAttentionV3Config,
    config_space,
    heuristic,
    ragged_page_attention_v3_pallas,
    supports,
    write_tokens,
)

SMALL = RaggedPageAttentionV3Config(fwd_params=FwdParams(q_blocksize=8, kv_blocksize=16))


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def inputs(
    batch: PagedBatch, dtype: str = "float32", num_seqs: int | None = None, **options: Any
) -> dict[str, Any]:
    live = len(batch.kv_lens) if num_seqs is None else num_seqs
    arrays = batch.example("packed", num_seqs=live, new_tokens=True).build(SPEC, dtype)
    return validated(SPEC, arrays, **options)


def check(args: dict[str, Any], cfg: Any = SMALL) -> tuple[jax.Array, ...]:
    out, key_cache, value_cache = ragged_page_attention_v3_pallas(**args, cfg=cfg)
    ref_out, ref_k, ref_v = SPEC.reference(**args)
    assert out.shape == args["queries"].shape and out.dtype == args["queries"].dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "an unwritten NaN slot was read"
    assert_close(out, ref_out, name="out")
    # Slots nobody owns hold NaN in both: compare them as equal.
    for ours, theirs in ((key_cache, ref_k), (value_cache, ref_v)):
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    return out, key_cache, value_cache


@pytest.mark.slow  # the conformance kit runs these batches in CI
def test_mixed_prefill_and_decode_write_then_attend_like_the_reference() -> None:
    args = inputs(MIXED, num_seqs=5)  # sequence 5 is dead: its tokens write nothing
    out, _, _ = check(args)
    dead = int(np.asarray(args["query_start_loc"])[5])
    assert not np.any(np.asarray(out[dead:]))


@pytest.mark.slow  # the conformance kit runs these batches in CI
def test_bfloat16_mqa_with_sinks_soft_cap_and_window_under_the_heuristic() -> None:
    aux = jnp.asarray(np.random.default_rng(5).standard_normal((MQA.hq, 2)), jnp.float32)
    args = inputs(MQA, "bfloat16", softmax_aux=aux, logits_soft_cap=10.0, sliding_window=(6, 0))
    check(args, cfg=None)


def test_the_update_writes_exactly_the_destination_rows() -> None:
    args = inputs(MIXED)
    kc, vc = args["key_cache"], args["value_cache"]
    num_pages, page_size = kc.shape[:2]
    tables = (args["kv_lens"], args["block_tables"], args["query_start_loc"], args["num_seqs"])
    dest = np.asarray(cache_destinations(*tables, args["keys"].shape[0], num_pages, page_size))
    assert (dest == -1).sum() >= 2  # the padding tokens
    new_k, new_v = write_tokens(kc, vc, args["keys"], args["values"], jnp.asarray(dest))
    flat_old = np.asarray(kc).reshape(num_pages * page_size, -1)
    flat_new = np.asarray(new_k).reshape(num_pages * page_size, -1)
    written = dest[dest >= 0]
    np.testing.assert_array_equal(
        flat_new[written], np.asarray(args["keys"])[dest >= 0].reshape(len(written), -1)
    )
    untouched = np.setdiff1d(np.arange(num_pages * page_size), written)
    np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])
    assert np.asarray(new_v).shape == np.asarray(vc).shape


def test_the_public_op_runs_the_kernels_under_jit_with_donated_caches() -> None:
    args = inputs(MIXED)
    sel = ejkernel.explain(ejkernel.ragged_page_attention_v3, **args, platform="pallas")
    assert sel.implementation.startswith("ejkernel_pallas.tpu."), sel
    names = ("key_cache", "value_cache")
    ref = SPEC.reference(**args)
    rest = {n: v for n, v in args.items() if n not in names}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(key_cache: jax.Array, value_cache: jax.Array) -> Any:
        return ejkernel.ragged_page_attention_v3(
            key_cache=key_cache, value_cache=value_cache, **rest, platform="pallas", cfg=SMALL
        )

    out, kc, _ = step(jnp.array(args["key_cache"]), jnp.array(args["value_cache"]))
    assert_close(out, ref[0], name="out")
    np.testing.assert_array_equal(np.asarray(kc, np.float32), np.asarray(ref[1], np.float32))


def test_config_rules_follow_the_attention_kernel() -> None:
    args = inputs(MIXED)
    inv = Invocation(kernel="ragged_page_attention_v3", kwargs=args)
    assert isinstance(heuristic(inv), RaggedPageAttentionV3Config)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and all(
        isinstance(c, RaggedPageAttentionV3Config) for c in space
    )
    assert supports(inv) is True
    scaled = Invocation(kernel="ragged_page_attention_v3", kwargs={**args, "k_scale": 0.5})
    assert "k_scale" in supports(scaled) and "ragged_page_attention_v3" in supports(scaled)


def test_the_update_lowers_to_a_mosaic_module_writing_the_aliased_caches_by_dma() -> None:
    from tests.pallas._mosaic_tpu import mosaic_ops

    from ejkernel_pallas.tpu import ragged_page_attention_v3 as module

    args = inputs(MQA, "bfloat16")
    dest = jnp.arange(args["keys"].shape[0], dtype=jnp.int32)
    arrays = [args[n] for n in ("key_cache", "value_cache", "keys", "values")]
    lowered = module._write.trace(*arrays, dest, interpret=False).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert "tpu_custom_call" in text and "ejkernel_paged_cache_write" in text
    assert "output_operand_aliases" in text  # the caches are updated in place
    ops = mosaic_ops(text)
    assert "tpu.enqueue_dma" in ops and any(op.startswith("tpu.wait_dma") for op in ops), ops
