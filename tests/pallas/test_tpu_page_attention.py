"""The Pallas Mosaic-TPU page_attention in TPU interpret mode on the CPU, against the reference
and against JAX's own ``pallas.ops.tpu.paged_attention``; its lowering to a Mosaic module.

Every batch is hostile (the shared paged cases): pages in shuffled order, table slots past the
live pages holding ``10**6`` and ``-1``, NaN in every cache slot no sequence owns (so in the tail
of a partly filled last page). Shapes stay tiny: the interpreter simulates every DMA.
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
from ejkernel.specs.page_attention import SPEC
from ejkernel.testing import assert_close
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel_pallas.tpu import _paged
from ejkernel_pallas.tpu import page_attention as module
from ejkernel_pallas.tpu.page_attention import (
    PageAttentionConfig,
    config_space,
    heuristic,
    page_attention_pallas,
    supports,
)

#: GQA 4:2, head dim 80, lengths odd, 1 (the query sees only itself) and 0 (zeros).
ODD = PagedBatch(kv_lens=(29, 1, 0, 17), hq=4, hkv=2, d=80, page_size=8, max_pages=5, num_pages=16)
#: MQA with 16-row pages (a bf16 tile), a sequence filling its capacity exactly.
MQA = PagedBatch(kv_lens=(48, 5), hq=2, hkv=1, d=128, page_size=16, max_pages=3, num_pages=7)
#: Two pages per kv block: several blocks per sequence, a tail block past the table's width.
TWO_PAGES = PageAttentionConfig(fwd_params=FwdParams(kv_blocksize=16))


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def inputs(
    batch: PagedBatch, dtype: str = "float32", unused: Any = GARBAGE, **options: Any
) -> dict[str, Any]:
    """Validated arguments of a hostile batch, as the core hands them to an implementation."""
    return validated(SPEC, batch.example("decode", unused=unused).build(SPEC, dtype), **options)


#: ``check(batch, dtype, cfg, **options)``: the output on a batch against the reference.
check = batch_checker(page_attention_pallas, SPEC, inputs, "query")


def test_gqa_odd_lengths_and_empty_sequences_match_the_reference_in_float32() -> None:
    out, _ = check(ODD, cfg=TWO_PAGES)
    assert not np.any(np.asarray(out[2]))  # kv_len 0: zeros


def test_bfloat16_mqa_with_the_heuristic_matches_the_reference() -> None:
    check(MQA, "bfloat16", softmax_scale=0.3)


def test_sliding_window_and_soft_cap_skip_hidden_pages_holding_nan() -> None:
    args = inputs(ODD, sliding_window=(9, 0), logits_soft_cap=2.0)
    # NaN in owned slots the window hides from the decode token (positions 0..18 of sequence 0).
    table = np.asarray(args["block_tables"])
    caches = {n: np.asarray(args[n]).copy() for n in ("key_cache", "value_cache")}
    for pos in range(29 - 1 - 9):
        for cache in caches.values():
            cache[table[0, pos // 8], pos % 8] = np.nan
    args |= {n: jnp.asarray(c) for n, c in caches.items()}
    out = page_attention_pallas(**args, cfg=TWO_PAGES)
    assert np.all(np.isfinite(np.asarray(out)))
    assert_close(out, SPEC.reference(**args), name="window")


def test_the_public_op_selects_the_kernel_with_platform_pallas_under_jit() -> None:
    args = ODD.example("decode").build(SPEC, "float32")
    call = lambda a: ejkernel.page_attention(**a, sliding_window=12, platform="pallas")
    sel = ejkernel.explain(ejkernel.page_attention, **args, platform="pallas")
    assert "ejkernel_pallas.tpu.page_attention" in sel.implementation
    out = jax.jit(call)(args)
    assert_close(out, SPEC.reference(**inputs(ODD, sliding_window=12)), name="public")


def test_matches_jax_paged_attention_in_interpret_mode() -> None:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    batch = attrs.evolve(ODD, kv_lens=(29, 1, 7, 17), max_pages=4)
    args = inputs(batch, unused=0)
    # JAX's kernel reads every page of a compute block: give it live ids and clean slots.
    table = np.asarray(args["block_tables"])
    live = np.arange(table.shape[1])[None, :] < -(-np.asarray(args["kv_lens"])[:, None] // 8)
    args["block_tables"] = jnp.asarray(np.where(live, table, table[:, :1]))
    for name in ("key_cache", "value_cache"):
        args[name] = jnp.nan_to_num(args[name])
    scale = args["softmax_scale"]
    ours = page_attention_pallas(**args, cfg=TWO_PAGES)
    with _compat_interpret():
        theirs = paged_attention(
            args["query"] * scale,
            jnp.transpose(args["key_cache"], (2, 0, 1, 3)),  # [Hkv, num_pages, page_size, D]
            jnp.transpose(args["value_cache"], (2, 0, 1, 3)),
            args["kv_lens"],
            args["block_tables"],
            pages_per_compute_block=2,
        )
    # JAX's kernel reads its pages as bfloat16 whatever their dtype: bf16 tolerance.
    assert_close(ours, theirs, dtype=jnp.bfloat16, name="jax paged_attention")


def _compat_interpret() -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())


def test_heuristic_blocks_are_whole_pages_and_fit_the_vmem_budget() -> None:
    args = inputs(ODD)
    cfg = heuristic(Invocation(kernel="page_attention", kwargs=args))
    assert cfg.fwd_params.kv_blocksize == 5 * 8  # 512 keys clamped to the table's width
    space = config_space(Invocation(kernel="page_attention", kwargs=args))
    assert space[0] == cfg and len(space) == len(set(space))
    assert all(c.fwd_params.kv_blocksize % 8 == 0 for c in space)
    # A huge page shrinks the block until one grid step fits the budget.
    big = {
        **args,
        "key_cache": jax.ShapeDtypeStruct((64, 256, 8, 256), jnp.float32),
        "block_tables": jax.ShapeDtypeStruct((4, 64), jnp.int32),
    }
    huge = {**big, "key_cache": jax.ShapeDtypeStruct((64, 1024, 8, 256), jnp.float32)}
    assert_huge_pages_fit_vmem(SPEC, module, supports, big, huge)
    assert supports(Invocation(kernel="page_attention", kwargs=big)) is True


def test_supports_declines_scales_odd_page_tiles_on_tpu_and_huge_tables() -> None:
    args = inputs(ODD)
    inv = lambda **kw: Invocation(kernel="page_attention", kwargs={**args, **kw})
    assert supports(inv()) is True
    assert "k_scale" in supports(inv(k_scale=0.5))
    assert "page_size" in _paged.page_layout_reason(8, jnp.bfloat16, "tpu")
    assert _paged.page_layout_reason(8, jnp.float32, "tpu") is None
    assert _paged.page_layout_reason(4, jnp.bfloat16, "cpu") is None  # the interpreter
    huge = jax.ShapeDtypeStruct((4, 100_000), jnp.int32)
    assert "SMEM" in supports(inv(block_tables=huge))


@pytest.mark.parametrize(("batch", "dtype"), [(ODD, "float32"), (MQA, "bfloat16")], ids=str)
def test_the_kernel_lowers_to_a_mosaic_module_for_the_tpu(batch: PagedBatch, dtype: str) -> None:
    args = inputs(batch, dtype, logits_soft_cap=3.0, sliding_window=(9, 0))
    lp = attrs.evolve(module._launch(args, TWO_PAGES), interpret=False)
    arrays = [args[n] for n in ("query", "key_cache", "value_cache", "kv_lens", "block_tables")]
    lowered = module._forward.trace(*arrays, lp=lp).lower(lowering_platforms=("tpu",))
    assert_paged_attention_kernel(lowered.as_text(), "ejkernel_page_attention_fwd")
