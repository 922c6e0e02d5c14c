"""The serving ops' query chunks on the Gluon ping-pong kernel (Hopper): which calls the
heuristic sends there, what the launch compiles to for sm_90 (on any machine), and, on a GPU,
every op that maps onto it against its reference on batches with NaN in each cache slot no
sequence owns, shuffled pages and garbage table ids past the live pages."""

from __future__ import annotations

import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.ops import FwdParams
from ejkernel.specs.prefill_page_attention import prefill_page_attention_reference
from ejkernel.specs.ragged_page_attention import ragged_page_attention_reference
from ejkernel.specs.unified_attention import unified_attention_reference

pytest.importorskip("triton")

from tests.triton._paged_helpers import check, packed

from ejkernel_triton.ops import ragged_page_attention as rpa
from ejkernel_triton.ops.unified_attention_config import (
    Problem,
    UnifiedAttentionConfig,
    config_space_of,
    pingpong_refusal,
)


def pingpong(keys: int = 128, stages: int = 2) -> UnifiedAttentionConfig:
    params = FwdParams(q_blocksize=128, kv_blocksize=keys, num_warps=4, num_stages=stages)
    return UnifiedAttentionConfig(fwd_params=params, num_splits=1, chunk_kernel="pingpong")


@pytest.fixture
def sm90(hopper_compile: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hopper GPU's choices, made on any machine."""
    from ejkernel_triton.ops import flash_attention_config

    monkeypatch.setattr(flash_attention_config, "_compute_capability", lambda: (9, 0))


def _mixed(**opts: Any) -> dict[str, Any]:
    """12 decodes and 2 chunks (300 and 45 queries), bfloat16, 32/8 heads, D 128."""
    kv = [700] * 12 + [1000, 45]
    opts = {"hq": 32, "hkv": 8, "d": 128, "dtype": jnp.bfloat16, **opts}
    return packed(kv, [1] * 12 + [300, 45], **opts)


def _inv(args: dict[str, Any]) -> Any:
    return types.SimpleNamespace(kwargs={"num_seqs": None, **args})


# -- which calls go to the kernel -------------------------------------------------------------


def test_the_heuristic_sends_a_mixed_batch_s_chunks_to_the_pingpong_kernel(sm90: None) -> None:
    cfg = rpa.heuristic(_inv(_mixed()))
    assert cfg.chunk_kernel == "pingpong"
    assert (cfg.fwd_params.kv_blocksize, cfg.fwd_params.num_stages, cfg.num_splits) == (128, 2, 1)
    space = rpa.config_space(_inv(_mixed()))
    assert space[0] == cfg
    kinds = {c.chunk_kernel for c in space}
    assert kinds == {"pingpong", "unified"}  # the tuner weighs both


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"sliding_window": (64, 0)}, "sliding_window"),
        ({"softmax_aux": jnp.zeros((32,))}, "softmax_aux"),
        ({"softmax_scale": -0.1}, "softmax_scale"),
        ({"k_scale": 1.0, "v_scale": 1.0}, "k_scale"),
        ({"d": 80}, "head dims"),
        ({"page_size": 4}, "page size"),
        ({"dtype": jnp.float32}, "bfloat16 and float16"),
        ({"decode": True}, "decode-like"),
    ],
)
def test_calls_the_pingpong_kernel_does_not_take_stay_on_the_unified_kernel(
    sm90: None, change: dict[str, Any], why: str
) -> None:
    batch_opts = {k: change.pop(k) for k in ("d", "page_size", "dtype") if k in change}
    q_lens = [1] * 14 if change.pop("decode", False) else [1] * 12 + [300, 45]
    opts = {"hq": 32, "hkv": 8, "d": 128, "dtype": jnp.bfloat16, **batch_opts}
    args = {**packed([700] * 12 + [1000, 45], q_lens, **opts), **change}
    problem = Problem.of(args["queries"], args["key_cache"], *args["block_tables"].shape)
    assert why in pingpong_refusal(args, problem, "queries")
    assert rpa.heuristic(_inv(args)).chunk_kernel == "unified"
    if "decode" not in why:
        with pytest.raises(ValueError, match=r"chunk_kernel='pingpong' cannot serve"):
            rpa.ragged_page_attention_triton(cfg=pingpong(), **args)


def test_no_gpu_no_pingpong_kernel(hopper_compile: None) -> None:
    args = _mixed()
    problem = Problem.of(args["queries"], args["key_cache"], *args["block_tables"].shape)
    assert "Hopper" in pingpong_refusal(args, problem, "queries")
    assert "pingpong" not in {c.chunk_kernel for c in config_space_of(problem, type(pingpong()))}


def test_the_pingpong_tile_is_checked(sm90: None) -> None:
    bad = attrs.evolve(pingpong(), fwd_params=FwdParams(kv_blocksize=32, num_stages=2))
    with pytest.raises(ValueError, match="kv_blocksize 64 or 128"):
        rpa.ragged_page_attention_triton(cfg=bad, **_mixed())


# -- what the GPU runs, compiled for sm_90 ----------------------------------------------------


@pytest.mark.parametrize(
    ("page_size", "keys", "d", "copies"),
    [(16, 128, 128, 8), (16, 64, 128, 4), (256, 128, 128, 1), (128, 128, 64, 1)],
    ids=["page16-keys128", "page16-keys64", "page256", "d64-page128"],
)
def test_the_launches_compile_for_hopper(
    sm90: None, page_size: int, keys: int, d: int, copies: int
) -> None:
    """The chunks of 64 queries or more on the ping-pong kernel, shorter chunks and decodes
    on the unified kernel; the ping-pong kernel a loader warp and two consumer warp groups, K and V by one TMA copy a page (two where a row is wider
    than the 128-byte swizzle), wgmma, within the H100's shared memory."""
    from ejkernel_triton import _codegen

    args = _mixed(page_size=page_size, d=d)
    with _codegen.recorded_launches() as record:
        rpa.ragged_page_attention_triton(cfg=pingpong(keys), **args)
    assert [launch.kernel.fn.__name__ for launch in record] == [
        "paged_attention_pingpong_kernel",
        "unified_attention_kernel",
        "unified_attention_kernel",
    ]
    chunks, short, decodes = record
    assert chunks.constexprs["MIN_Q_LEN"] == 64  # the chunk of 300; the one of 45 is short
    assert (short.constexprs["MIN_Q_LEN"], short.constexprs["MAX_Q_LEN"]) == (2, 63)
    assert short.constexprs["BLOCK_M"] == 64 and not short.constexprs["DECODE"]
    assert decodes.constexprs["DECODE"] and decodes.grid[0] == 14  # one row a table row
    assert chunks.grid == (args["queries"].shape[0] // 128 + 14, 32)
    compiled = _codegen.compile_launch(chunks, capability=90)
    assert compiled.num_warps == 12
    boxes = d * 2 // 128  # TMA boxes a row: 128 bytes each under the 128-byte swizzle
    assert compiled.ptx.count("cp.async.bulk.tensor") == (2 + 2 * copies) * boxes
    assert any(k.startswith("wgmma") for k in _codegen.instruction_mix(compiled.ptx))
    assert compiled.shared <= 232448


# -- GPU: against the references ---------------------------------------------------------------


def _gpu_check(out: jax.Array, ref: jax.Array) -> None:
    check(out, ref, dtype=jnp.bfloat16)


GPU_CASES = {
    "mixed-page16": ({}, {}, pingpong()),
    "mixed-keys64-3-stages": ({}, {}, pingpong(64, 3)),
    "page32-soft-cap-scale": (
        {"page_size": 32},
        {"logits_soft_cap": 20.0, "softmax_scale": 0.05},
        pingpong(128, 3),
    ),
    "page256": ({"page_size": 256}, {}, pingpong()),
    "d64-gqa2": ({"d": 64, "hq": 16, "hkv": 8}, {}, pingpong()),
    "mha-page8": ({"hq": 8, "hkv": 8, "page_size": 8}, {}, pingpong(64, 2)),
    "noncausal": ({}, {"causal": False}, pingpong()),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_unified_attention_on_the_pingpong_kernel(case: str) -> None:
    """Decodes, chunks of 2 to 300 queries (not multiples of 128; those under 64 on the
    unified kernel), a length-1 context, tokens of no sequence."""
    batch_opts, opts, cfg = GPU_CASES[case]
    shape = {"hq": 32, "hkv": 8, "d": 128, **batch_opts}
    kv_lens = [700, 1, 1000, 45, 260, 3, 129, 900]
    q_lens = [1, 1, 300, 45, 2, 3, 129, 1]
    args = packed(kv_lens, q_lens, **shape, dtype=jnp.bfloat16, pad_tokens=5)
    run = jax.jit(lambda a: ejkernel.unified_attention(**a, **opts, platform="triton", cfg=cfg))
    _gpu_check(run(args), unified_attention_reference(**args, **opts))


@pytest.mark.gpu
def test_gpu_ragged_page_attention_on_the_pingpong_kernel_by_default() -> None:
    """The heuristic's choice on a Hopper GPU, past-``num_seqs`` rows unread."""
    args = packed(
        [2000, 1, 3000, 517], [1, 1, 512, 200], hq=32, hkv=8, d=128, dtype=jnp.bfloat16,
        extra_rows=2,
    )  # fmt: skip
    record = ejkernel.explain("ragged_page_attention", **args, num_seqs=4)
    assert record.platform == "triton" and record.config.chunk_kernel == "pingpong", record
    run = jax.jit(lambda a: ejkernel.ragged_page_attention(**a, num_seqs=4, platform="triton"))
    ref = ragged_page_attention_reference(**args, num_seqs=4)
    _gpu_check(run(args), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [2048, 77])
def test_gpu_prefill_page_attention_on_the_pingpong_kernel(chunk: int) -> None:
    """One sequence's chunk over an 8k context (its queries the last of 8000 tokens)."""
    b = packed([8000], [chunk], hq=32, hkv=8, d=128, dtype=jnp.bfloat16)
    args = {
        "query": b["queries"],
        "key_cache": b["key_cache"],
        "value_cache": b["value_cache"],
        "kv_len": b["kv_lens"][0],
        "page_indices": b["block_tables"][0],
    }
    record = ejkernel.explain("prefill_page_attention", **args)
    assert record.config.chunk_kernel == "pingpong", record
    out = jax.jit(lambda a: ejkernel.prefill_page_attention(**a, platform="triton"))(args)
    _gpu_check(out, prefill_page_attention_reference(**args))
