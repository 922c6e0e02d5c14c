"""The Pallas Mosaic-TPU prefill_page_attention (one sequence through the ragged paged kernel)
in TPU interpret mode on the CPU, against the spec's reference.

Pages in shuffled order, table entries past the live pages holding garbage, NaN in every cache
slot the sequence does not own; a chunk longer than the sequence (queries at negative
positions return zeros); a traced ``kv_len``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas._paged_helpers import check_output, validated

import ejkernel
from ejkernel.ops import FwdParams, Invocation
from ejkernel.specs.prefill_page_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import PagedBatch
from ejkernel_pallas.tpu.prefill_page_attention import (
    PrefillPageAttentionConfig,
    config_space,
    heuristic,
    prefill_page_attention_pallas,
    supports,
)

CHUNK = PagedBatch(
    kv_lens=(37,), q_lens=(13,), hq=6, hkv=2, d=80, page_size=8, max_pages=6, num_pages=16
)
SMALL = PrefillPageAttentionConfig(fwd_params=FwdParams(q_blocksize=8, kv_blocksize=16))


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def inputs(batch: PagedBatch, dtype: str = "float32", **options: Any) -> dict[str, Any]:
    return validated(SPEC, batch.example("prefill").build(SPEC, dtype), **options)


def check(args: dict[str, Any], dtype: str = "float32", cfg: Any = SMALL) -> Any:
    checks = {"query": "query", "dtype": dtype, "cfg": cfg, "name": "prefill"}
    return check_output(prefill_page_attention_pallas, SPEC, args, **checks)


@pytest.mark.slow  # the conformance kit runs these chunks in CI
def test_a_chunk_at_the_end_of_its_sequence_matches_the_reference() -> None:
    check(inputs(CHUNK))


@pytest.mark.slow  # the conformance kit runs these chunks in CI
def test_bfloat16_soft_cap_and_window_under_the_heuristic() -> None:
    args = inputs(CHUNK, "bfloat16", logits_soft_cap=10.0, sliding_window=(9, 0))
    check(args, "bfloat16", cfg=None)


def test_queries_before_the_first_token_return_zeros() -> None:
    args = inputs(CHUNK) | {"kv_len": jnp.asarray(9, jnp.int32)}  # 13 queries, 9 tokens
    out = check(args)
    assert not np.any(np.asarray(out[:4]))


def test_the_public_op_runs_the_kernel_with_a_traced_kv_len() -> None:
    args = inputs(CHUNK)
    sel = ejkernel.explain(ejkernel.prefill_page_attention, **args, platform="pallas")
    assert sel.implementation.startswith("ejkernel_pallas.tpu."), sel
    rest = {n: v for n, v in args.items() if n != "kv_len"}
    run = jax.jit(
        lambda kv_len: ejkernel.prefill_page_attention(
            kv_len=kv_len, **rest, platform="pallas", cfg=SMALL
        )
    )
    assert_close(run(args["kv_len"]), SPEC.reference(**args), name="traced kv_len")


def test_config_rules_are_the_ragged_kernels_for_one_sequence() -> None:
    inv = Invocation(kernel="prefill_page_attention", kwargs=inputs(CHUNK))
    base = heuristic(inv)
    assert isinstance(base, PrefillPageAttentionConfig)
    space = config_space(inv)
    assert space[0] == base and all(isinstance(c, PrefillPageAttentionConfig) for c in space)
    assert supports(inv) is True
    scaled = Invocation(kernel="prefill_page_attention", kwargs={**inv.kwargs, "v_scale": 0.5})
    assert "prefill_page_attention" in supports(scaled) and "v_scale" in supports(scaled)
