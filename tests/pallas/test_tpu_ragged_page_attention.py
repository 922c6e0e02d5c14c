"""The Pallas Mosaic-TPU ragged_page_attention in TPU interpret mode on the CPU, against the
reference and against JAX's own ``pallas.ops.tpu.ragged_paged_attention``; its lowering to a
Mosaic module.

Every batch is hostile (the shared paged cases): pages in shuffled order, table slots past the
live pages holding ``10**6`` and ``-1``, NaN in every cache slot no sequence owns. Query blocks
of 8 tokens make blocks that hold the tail of one sequence, whole short ones and the head of
the next. Shapes stay tiny: the interpreter simulates every DMA.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas._mosaic_tpu import assert_paged_attention_kernel
from tests.pallas._paged_helpers import (
    assert_huge_pages_fit_vmem,
    batch_checker,
    validated,
)

import ejkernel
from ejkernel.ops import FwdParams, Invocation
from ejkernel.specs.ragged_page_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel_pallas.tpu import ragged_page_attention as module
from ejkernel_pallas.tpu.ragged_page_attention import (
    RaggedPageAttentionConfig,
    config_space,
    heuristic,
    ragged_page_attention_pallas,
    supports,
)

#: GQA 4:2, head dim 80: prefill chunks, an empty sequence, decode steps (one of them on a
#: length-1 context), a sequence whose queries are its whole cache, two padding tokens.
MIXED = PagedBatch(
    kv_lens=(13, 0, 9, 29, 1, 7),
    q_lens=(5, 0, 1, 11, 1, 7),
    hq=4,
    hkv=2,
    d=80,
    page_size=8,
    max_pages=5,
    num_pages=20,
    pad_tokens=2,
)
#: MQA with 16-row pages (a bf16 tile).
MQA = PagedBatch(
    kv_lens=(40, 5, 17),
    q_lens=(9, 1, 3),
    hq=2,
    hkv=1,
    d=128,
    page_size=16,
    max_pages=3,
    num_pages=8,
)
#: 8-token query blocks, two pages per kv block.
SMALL = RaggedPageAttentionConfig(fwd_params=FwdParams(q_blocksize=8, kv_blocksize=16))


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def inputs(
    batch: PagedBatch,
    dtype: str = "float32",
    num_seqs: int | None = None,
    unused: Any = GARBAGE,
    **options: Any,
) -> dict[str, Any]:
    """Validated arguments of a hostile batch, as the core hands them to an implementation."""
    live = len(batch.kv_lens) if num_seqs is None else num_seqs
    arrays = batch.example("packed", num_seqs=live, unused=unused).build(SPEC, dtype)
    return validated(SPEC, arrays, **options)


#: ``check(batch, dtype, cfg, **options)``: the output on a batch against the reference.
check = batch_checker(ragged_page_attention_pallas, SPEC, inputs, "queries")


def test_mixed_prefill_and_decode_match_the_reference_in_float32() -> None:
    out, _ = check(MIXED, cfg=SMALL)
    assert not np.any(np.asarray(out[-2:]))  # padding tokens belong to no sequence


def test_sequences_past_num_seqs_give_zeros() -> None:
    out, args = check(MIXED, cfg=SMALL, num_seqs=4)
    dead = int(np.asarray(args["query_start_loc"])[4])
    assert not np.any(np.asarray(out[dead:]))


def test_bfloat16_mqa_with_the_heuristic_matches_the_reference() -> None:
    check(MQA, "bfloat16", softmax_scale=0.3)


@pytest.mark.parametrize("sinks", ["Hq", "Hq-2"])
def test_sliding_window_soft_cap_and_sinks_match_the_reference(sinks: str) -> None:
    shape = (MIXED.hq,) if sinks == "Hq" else (MIXED.hq, 2)
    aux = jnp.asarray(np.random.default_rng(5).standard_normal(shape) + 1.0, jnp.float32)
    check(MIXED, cfg=SMALL, sliding_window=(6, 2), logits_soft_cap=3.0, softmax_aux=aux)


def test_nan_causally_after_a_query_or_outside_its_window_reaches_no_row() -> None:
    args = inputs(MIXED, sliding_window=(4, 0))
    table, qsl = np.asarray(args["block_tables"]), np.asarray(args["query_start_loc"])
    caches = {n: np.asarray(args[n]).copy() for n in ("key_cache", "value_cache")}
    # Sequence 3 (29 keys, queries at positions 18..28, windows [p - 4, p]): NaN at position 26
    # (causally after queries 18..25, seen by 26..28) and at position 2 (outside every window).
    for pos in (2, 26):
        for cache in caches.values():
            cache[table[3, pos // 8], pos % 8] = np.nan
    args |= {n: jnp.asarray(c) for n, c in caches.items()}
    out = np.asarray(ragged_page_attention_pallas(**args, cfg=SMALL))
    ref = np.asarray(SPEC.reference(**args))
    sees_nan = np.zeros(out.shape[0], bool)
    sees_nan[qsl[3] + 26 - 18 : qsl[4]] = True  # queries at positions 26..28 see position 26
    assert np.all(np.isfinite(out[~sees_nan]))
    assert_close(out[~sees_nan], ref[~sees_nan], name="hidden NaN")


def test_the_public_op_runs_the_kernel_with_a_traced_num_seqs() -> None:
    args = MIXED.example("packed", num_seqs=5).build(SPEC, "float32")
    sel = ejkernel.explain(ejkernel.ragged_page_attention, **args, platform="pallas")
    assert "ejkernel_pallas.tpu.ragged_page_attention" in sel.implementation
    call = lambda a: ejkernel.ragged_page_attention(**a, platform="pallas")
    assert_close(jax.jit(call)(args), SPEC.reference(**inputs(MIXED, num_seqs=5)), name="op")


def test_matches_jax_ragged_paged_attention_semantics() -> None:
    # JAX's kernel reshapes refs, which its TPU interpreter (jax 0.10) cannot run: compare with
    # its own plain-JAX reference of the same semantics instead.
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    batch = attrs.evolve(MIXED, kv_lens=(13, 3, 9, 29, 1, 7), q_lens=(5, 1, 1, 11, 1, 7))
    args = inputs(batch, unused=0, sliding_window=(5, 5), logits_soft_cap=4.0)
    for name in ("key_cache", "value_cache"):
        args[name] = jnp.nan_to_num(args[name])
    ours = ragged_page_attention_pallas(**args, cfg=SMALL)
    # JAX's layout: K and V heads interleaved, [num_pages, page_size, 2 * Hkv, D]; its window
    # w sees [p - w + 1, p].
    kv = jnp.stack([args["key_cache"], args["value_cache"]], axis=3)
    kv = kv.reshape(*kv.shape[:2], -1, kv.shape[-1])
    theirs = ref_ragged_paged_attention(
        args["queries"],
        kv,
        args["kv_lens"],
        args["block_tables"],
        args["query_start_loc"],
        np.asarray(args["num_seqs"]).reshape(1),
        sm_scale=args["softmax_scale"],
        sliding_window=6,
        soft_cap=4.0,
    )
    live = int(np.asarray(args["query_start_loc"])[-1])
    assert_close(ours[:live], theirs, name="jax ragged_paged_attention")


def test_heuristic_and_config_space_give_tpu_tiles_that_fit_the_vmem_budget() -> None:
    args = inputs(MIXED)
    inv = Invocation(kernel="ragged_page_attention", kwargs=args)
    cfg = heuristic(inv)
    assert cfg.fwd_params.q_blocksize == 32  # 128 rows / G=2, clamped to the 32 padded tokens
    assert cfg.fwd_params.kv_blocksize == 5 * 8
    space = config_space(inv)
    assert space[0] == cfg and len(space) == len(set(space))
    for c in space:
        assert c.fwd_params.q_blocksize % 8 == 0 and c.fwd_params.kv_blocksize % 8 == 0
    big = {**args, "key_cache": jax.ShapeDtypeStruct((64, 512, 2, 256), jnp.float32)}
    huge = {**args, "key_cache": jax.ShapeDtypeStruct((64, 4096, 2, 256), jnp.float32)}
    assert_huge_pages_fit_vmem(SPEC, module, supports, big, huge)


def test_supports_declines_scales_and_tables_that_overflow_smem() -> None:
    args = inputs(MIXED)
    inv = lambda **kw: Invocation(kernel="ragged_page_attention", kwargs={**args, **kw})
    assert supports(inv()) is True
    assert "v_scale" in supports(inv(v_scale=0.5))
    huge = jax.ShapeDtypeStruct((6, 100_000), jnp.int32)
    assert "SMEM" in supports(inv(block_tables=huge))


@pytest.mark.parametrize(("batch", "dtype"), [(MIXED, "float32"), (MQA, "bfloat16")], ids=str)
def test_the_kernel_lowers_to_a_mosaic_module_for_the_tpu(batch: PagedBatch, dtype: str) -> None:
    aux = jnp.ones((batch.hq,), jnp.float32)
    args = inputs(batch, dtype, sliding_window=(6, 0), logits_soft_cap=3.0, softmax_aux=aux)
    lp = attrs.evolve(module._launch(args, 8, 16), interpret=False)
    names = ("queries", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc")
    arrays = [args[n] for n in names] + [args["num_seqs"], aux]
    lowered = module._forward.trace(*arrays, lp=lp).lower(lowering_platforms=("tpu",))
    assert_paged_attention_kernel(lowered.as_text(), "ejkernel_ragged_page_attention_fwd")
