"""The Triton serving attention (one kernel: unified, ragged, page and prefill attention)
against each op's reference.

In Triton's interpreter on the CPU (tiny shapes, float32 unless said) with explicit small
tiles, so batches cross several tiles, pages and splits; every cache slot no live sequence
owns holds NaN (a slot past a length, a page nobody holds), and table slots past the live
pages hold garbage ids. ``gpu``-marked tests run serving shapes against the XLA platform.
"""

from __future__ import annotations

import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.triton._shared_memory import spaces_with_and_without_limit

import ejkernel
from ejkernel.specs._paged import paged_block_tables
from ejkernel.specs.page_attention import page_attention_reference
from ejkernel.specs.prefill_page_attention import prefill_page_attention_reference
from ejkernel.specs.ragged_page_attention import ragged_page_attention_reference
from ejkernel.specs.unified_attention import unified_attention_reference

pytest.importorskip("triton")

from tests.triton._paged_helpers import (
    assert_pipelined_matrix_code,
    check,
    hopper_launch,
    packed,
    small,
)

from ejkernel_triton.ops.unified_attention import UnifiedAttentionConfig
from ejkernel_triton.ops.unified_attention_config import (
    Problem,
    config_space_of,
    heuristic_config,
    serving_supports,
)

# -- unified_attention: features --------------------------------------------------------------

#: (kv_lens, q_lens, batch options, op options, config): each feature on a ragged batch with
#: a decode token, a prefill chunk and a length-1 context.
UNIFIED_CASES = {
    "plain": ([37, 1, 20], [5, 1, 20], {}, {}, small()),
    "gqa-4": ([45, 9], [3, 9], {"hq": 8, "hkv": 2}, {}, small()),
    "mqa-d80": ([33, 2], [4, 1], {"hq": 4, "hkv": 1, "d": 80}, {}, small()),
    "window": ([50, 19], [12, 1], {}, {"sliding_window": (7, 0)}, small()),
    "window-noncausal": ([40], [9], {}, {"sliding_window": (6, 3), "causal": False}, small()),
    "noncausal": ([30, 5], [8, 5], {}, {"causal": False}, small()),
    "soft-cap-scale": (
        [37, 3],
        [6, 1],
        {},
        {"logits_soft_cap": 2.0, "softmax_scale": 0.3},
        small(),
    ),
    "page-256": ([300, 5], [3, 1], {"page_size": 256}, {}, small(keys=64)),
    "d256": ([40, 2], [3, 1], {"d": 256, "hq": 2, "hkv": 1}, {}, small()),
    "sinks": ([37, 3, 0], [6, 1, 0], {}, {"softmax_aux": "sinks"}, small(splits=3)),
    "alibi": ([41, 6], [7, 1], {"hq": 4, "hkv": 2}, {"alibi_slopes": "slopes"}, small()),
    "split-k": ([70, 1, 33], [1, 1, 4], {}, {}, small(splits=3)),
    "tile-in-page": ([70, 12], [9, 1], {"page_size": 32}, {}, small(keys=16)),
    "tile-across-pages": ([70, 12], [9, 1], {"page_size": 16}, {}, small(keys=32)),
    "wide-rows": ([45, 9], [17, 2], {"hq": 8, "hkv": 2}, {}, small(rows=64, splits=2)),
    "decode-launch": (
        [37, 1, 20, 0, 45, 2],
        [5, 1, 20, 0, 1, 1],
        {"hq": 8, "hkv": 2},
        {"softmax_aux": "sinks"},
        attrs.evolve(small(splits=2), decode_launch=True),
    ),
}


@pytest.mark.parametrize("case", list(UNIFIED_CASES))
def test_unified_attention(interpret: None, case: str) -> None:
    kv_lens, q_lens, batch_opts, opts, cfg = UNIFIED_CASES[case]
    args = packed(kv_lens, q_lens, **batch_opts)
    hq = args["queries"].shape[1]
    key = jax.random.PRNGKey(1)
    if opts.get("softmax_aux") == "sinks":
        opts = {**opts, "softmax_aux": jax.random.normal(key, (hq, 2))}
    if opts.get("alibi_slopes") == "slopes":
        opts = {**opts, "alibi_slopes": 2.0 ** -jnp.arange(1, hq + 1, dtype=jnp.float32)}
    out = ejkernel.unified_attention(**args, **opts, platform="triton", cfg=cfg)
    check(out, unified_attention_reference(**args, **opts))


def test_a_mixed_batch_with_a_decode_launch_runs_two_kernels_serving_each_kind() -> None:
    """``decode_launch``: the decodes at 16 rows a program and split-K, the chunks at the
    config's rows, one launch each; a decode-like batch keeps one launch."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops.unified_attention import paged_attention

    args = packed([37, 1, 20, 45], [5, 1, 20, 1], hq=8, hkv=2)
    cfg = attrs.evolve(small(rows=64), decode_launch=True)
    with _codegen.recorded_launches() as record:
        paged_attention(cfg, args)
    # the chunks (the decodes' programs return at once), then the decodes: one row a table row
    assert [launch.constexprs["MIN_Q_LEN"] for launch in record] == [2, 1]
    assert [launch.constexprs["DECODE"] for launch in record] == [False, True]
    assert [launch.constexprs["BLOCK_M"] for launch in record] == [64, 16]
    assert record[1].grid[0] == 4

    decodes = packed([37, 1, 20, 45], [1, 1, 1, 1], hq=8, hkv=2)
    with _codegen.recorded_launches() as record:
        paged_attention(cfg, decodes)
    assert [launch.constexprs["MIN_Q_LEN"] for launch in record] == [1]


def test_the_kernel_serves_the_sequences_its_query_length_bounds_name(interpret: None) -> None:
    """``MIN_Q_LEN``/``MAX_Q_LEN``: each launch serves its sequences and leaves the others'
    tokens zero; the launches of disjoint bounds add up to the one of every sequence."""
    from ejkernel_triton import _codegen, _launch
    from ejkernel_triton.ops.unified_attention import paged_attention

    q_lens = [5, 1, 20, 3, 9]
    args = packed([37, 1, 20, 45, 9], q_lens, hq=8, hkv=2)
    with _codegen.recorded_launches() as record:
        paged_attention(small(), args)
    (launch,) = record

    def served(lo: int, hi: int) -> jax.Array:
        (out, _) = _launch.launch(
            launch.kernel, *launch.args, out_shape=launch.out_shape, grid=launch.grid,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
            zeroed_outputs=launch.zeroed_outputs,
            **{**launch.constexprs, "MIN_Q_LEN": lo, "MAX_Q_LEN": hi},
        )  # fmt: skip
        return out

    every = served(1, 0)
    parts = [served(1, 1), served(2, 5), served(6, 0)]
    token_len = np.repeat(q_lens, q_lens)
    for (lo, hi), part in zip([(1, 1), (2, 5), (6, 10**9)], parts, strict=True):
        mine = (token_len >= lo) & (token_len <= hi)
        assert bool(jnp.all(part[~mine] == 0)) and bool(jnp.all(part[mine] == every[mine]))
    check(sum(parts), unified_attention_reference(**args))


def test_unified_attention_bf16_default_config(interpret: None) -> None:
    """The heuristic's config (no ``cfg``), bfloat16, through the default selection."""
    args = packed([37, 1, 20], [5, 1, 20], hq=8, hkv=2, dtype=jnp.bfloat16)
    record = ejkernel.explain("unified_attention", **args)
    assert record.platform == "triton", record.rejected
    out = ejkernel.unified_attention(**args)
    ref = unified_attention_reference(**{n: _f32(x) for n, x in args.items()})
    check(out, ref, dtype=jnp.bfloat16)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


# -- ragged_page_attention ------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 2])
def test_ragged_page_attention_live_rows(interpret: None, splits: int) -> None:
    """``num_seqs`` (traced) below the table's rows, an empty sequence, a length-1 context,
    tokens of no sequence, sinks: rows past ``num_seqs`` and pad tokens are zeros."""
    args = packed([29, 0, 1, 18], [6, 0, 1, 3], extra_rows=2, pad_tokens=3)
    aux = jax.random.normal(jax.random.PRNGKey(2), (4,))
    cfg = small(splits=splits)

    @jax.jit
    def ours(args: dict[str, Any], num_seqs: jax.Array) -> jax.Array:
        return ejkernel.ragged_page_attention(
            **args, num_seqs=num_seqs, softmax_aux=aux, platform="triton", cfg=cfg
        )

    for live in (4, 2):
        num_seqs = jnp.asarray(live, jnp.int32)
        out = ours(args, num_seqs)
        ref = ragged_page_attention_reference(**args, num_seqs=num_seqs, softmax_aux=aux)
        check(out, ref)
    assert not bool(jnp.any(out[7:])), "tokens of no live sequence must be zeros"


def test_ragged_page_attention_bf16(interpret: None) -> None:
    args = packed([40, 3, 17], [8, 1, 17], hq=8, hkv=2, dtype=jnp.bfloat16, seed=3)
    opts = {"sliding_window": 9, "logits_soft_cap": 4.0}
    out = ejkernel.ragged_page_attention(**args, num_seqs=3, **opts, platform="triton", cfg=small())
    ref = ragged_page_attention_reference(
        **{n: _f32(x) for n, x in args.items()}, num_seqs=3, **opts
    )
    check(out, ref, dtype=jnp.bfloat16)


# -- page_attention and prefill_page_attention ------------------------------------------------


def decode_args(kv_lens: list[int], dtype: Any = jnp.float32, **kw: Any) -> dict[str, Any]:
    a = packed(kv_lens, [1] * len(kv_lens), dtype=dtype, **kw)
    return {
        "query": a["queries"],
        "key_cache": a["key_cache"],
        "value_cache": a["value_cache"],
        "kv_lens": a["kv_lens"],
        "block_tables": a["block_tables"],
    }


@pytest.mark.parametrize(
    ("opts", "cfg"),
    [
        ({}, small()),
        ({"sliding_window": (10, 0), "logits_soft_cap": 3.0}, small(splits=2)),
        ({}, None),
    ],
    ids=["plain", "window-cap-split", "heuristic"],
)
def test_page_attention(interpret: None, opts: dict[str, Any], cfg: Any) -> None:
    args = decode_args([0, 1, 47, 16, 33], hq=8, hkv=2)
    out = ejkernel.page_attention(**args, **opts, platform="triton", cfg=cfg)
    check(out, page_attention_reference(**args, **opts))
    assert not bool(jnp.any(out[0])), "kv_len 0 gives zeros"


def test_page_attention_bf16(interpret: None) -> None:
    args = decode_args([5, 60, 23], dtype=jnp.bfloat16, hq=4, hkv=1, d=96)
    out = ejkernel.page_attention(**args, platform="triton", cfg=small(splits=2))
    ref = page_attention_reference(**{n: _f32(x) for n, x in args.items()})
    check(out, ref, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    ("kv_len", "chunk", "opts"),
    [(45, 13, {}), (9, 14, {}), (50, 20, {"sliding_window": 6})],
    ids=["chunk", "chunk-longer-than-context", "window"],
)
def test_prefill_page_attention(
    interpret: None, kv_len: int, chunk: int, opts: dict[str, Any]
) -> None:
    a = packed([kv_len], [chunk], hq=4, hkv=2)
    args = {
        "query": a["queries"],
        "key_cache": a["key_cache"],
        "value_cache": a["value_cache"],
        "kv_len": kv_len,
        "page_indices": a["block_tables"][0],
    }
    out = ejkernel.prefill_page_attention(**args, **opts, platform="triton", cfg=small())
    check(out, prefill_page_attention_reference(**args, **opts))


# -- hidden slots contribute nothing --------------------------------------------------------


@pytest.mark.parametrize("where", ["causal-future", "outside-window"])
def test_hidden_nan_contributes_nothing(interpret: None, where: str) -> None:
    """NaN at a key position of a sequence's live pages: every row that cannot see it keeps
    the clean reference's output (a prefill chunk's later key; a key left of the window)."""
    kv_len, chunk, window = 40, 24, (5, 0)
    args = packed([kv_len], [chunk])
    opts = {"sliding_window": window} if where == "outside-window" else {}
    position = 30 if where == "causal-future" else 20  # queries sit at positions 16..39
    page = int(args["block_tables"][0, position // 16])
    poisoned = {
        **args,
        "key_cache": args["key_cache"].at[page, position % 16].set(jnp.nan),
        "value_cache": args["value_cache"].at[page, position % 16].set(jnp.inf),
    }
    out = ejkernel.unified_attention(**poisoned, **opts, platform="triton", cfg=small())
    ref = unified_attention_reference(**args, **opts)
    q_pos = np.arange(kv_len - chunk, kv_len)
    blind = q_pos < position if where == "causal-future" else q_pos - window[0] > position
    assert blind.any() and (~blind).any()
    check(out[blind], ref[blind])


# -- config, heuristic and supports ----------------------------------------------------------


def _problem(tokens: int, rows: int, capacity: int, **kw: Any) -> Problem:
    sizes = {"hq": 32, "hkv": 8, "head_dim": 128, "page_size": 16, "num_pages": 1 << 16}
    sizes.update({"itemsize": 2, **kw})
    return Problem(tokens=tokens, rows=rows, max_pages=capacity // sizes["page_size"], **sizes)


def test_heuristic_splits_decode_not_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K for a small decode batch over long contexts, none for a prefill-heavy one;
    decode rows 16, prefill rows 128; shared memory within Hopper's."""
    monkeypatch.delenv("EJKERNEL_INTERPRET", raising=False)
    long_decode = heuristic_config(_problem(1, 1, 131072), UnifiedAttentionConfig)
    assert long_decode.num_splits > 8
    assert long_decode.fwd_params.q_blocksize == 16
    mixed = heuristic_config(_problem(64 + 2 * 2048, 66, 16384), UnifiedAttentionConfig)
    assert mixed.num_splits == 1 and mixed.fwd_params.q_blocksize == 128
    short = heuristic_config(_problem(256, 256, 128), UnifiedAttentionConfig)
    assert short.num_splits == 1
    space = config_space_of(_problem(32, 32, 8192, head_dim=256), UnifiedAttentionConfig)
    assert space[0] == heuristic_config(
        _problem(32, 32, 8192, head_dim=256), UnifiedAttentionConfig
    )
    assert len(space) >= 3
    # float8 caches: V tiles loaded as words; the space keeps the byte loads
    fp8 = _problem(32, 32, 8192, itemsize=1)
    assert heuristic_config(fp8, UnifiedAttentionConfig).fp8_v_words
    assert not long_decode.fp8_v_words
    assert any(not cfg.fp8_v_words for cfg in config_space_of(fp8, UnifiedAttentionConfig))


def test_config_space_drops_tiles_over_the_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """An sm_86-sized limit at D 256: the large tiles go, the heuristic's stays, and every
    kept candidate fits."""
    from ejkernel_triton.ops.unified_attention_config import smem_need

    monkeypatch.delenv("EJKERNEL_INTERPRET", raising=False)
    problem = _problem(64, 64, 8192, head_dim=256)
    everything, kept = spaces_with_and_without_limit(
        monkeypatch, lambda: config_space_of(problem, UnifiedAttentionConfig), 101376
    )
    assert kept[0] == everything[0] and len(kept) < len(everything)
    assert all(smem_need(problem, cfg) <= 101376 for cfg in kept[1:])


def test_supports_takes_fp8_caches_declines_wide_heads(interpret: None) -> None:
    cache = jax.ShapeDtypeStruct((4, 16, 2, 64), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((3, 4, 64), jnp.bfloat16)
    kw = {"queries": q, "key_cache": cache, "value_cache": cache}
    assert serving_supports(kw, "queries") is True
    assert serving_supports({**kw, "k_scale": 0.5, "v_scale": 0.5}, "queries") is True
    fp8 = jax.ShapeDtypeStruct((4, 16, 2, 64), jnp.float8_e4m3fn)
    assert serving_supports({**kw, "key_cache": fp8, "value_cache": fp8}, "queries") is True
    e5 = jax.ShapeDtypeStruct((4, 16, 2, 64), jnp.float8_e5m2)
    assert "key_cache" in serving_supports({**kw, "key_cache": e5}, "queries")
    wide = jax.ShapeDtypeStruct((4, 16, 2, 512), jnp.bfloat16)
    why = serving_supports({**kw, "key_cache": wide, "value_cache": wide}, "queries")
    assert "head dim" in why
    from ejkernel_triton.ops import page_attention

    inv = types.SimpleNamespace(kwargs={"query": q, "key_cache": cache, "value_cache": cache})
    assert page_attention.supports(inv) is True


# -- GPU: serving shapes against the XLA platform --------------------------------------------


def _serving_batch(kv_lens: list[int], q_lens: list[int], seed: int = 0) -> dict[str, Any]:
    """32/8 heads, D 128, page 16, bfloat16; random pages, -1 past the live ones."""
    rng = np.random.default_rng(seed)
    page, hkv, hq, d = 16, 8, 32, 128
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = sum(-(-n // page) for n in kv_lens) + 8
    tables = paged_block_tables(
        rng, kv_lens, num_pages=num_pages, page_size=page, max_pages=max_pages, unused=-1
    )
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    t = sum(q_lens)
    return {
        "queries": jax.random.normal(keys[0], (t, hq, d), jnp.bfloat16),
        "key_cache": jax.random.normal(keys[1], (num_pages, page, hkv, d), jnp.bfloat16),
        "value_cache": jax.random.normal(keys[2], (num_pages, page, hkv, d), jnp.bfloat16),
        "kv_lens": jnp.asarray(kv_lens, jnp.int32),
        "block_tables": jnp.asarray(tables),
        "query_start_loc": jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    }


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.gpu
def test_gpu_mixed_batch_with_a_decode_launch() -> None:
    """12 decodes and 4 chunks of 512 over 2k-4k contexts, the decodes in a launch of their
    own (``decode_launch``), against XLA."""
    rng = np.random.default_rng(4)
    b = _serving_batch([int(n) for n in rng.integers(2048, 4097, 16)], [1] * 12 + [512] * 4)
    problem = Problem.of(b["queries"], b["key_cache"], *b["block_tables"].shape)
    cfg = attrs.evolve(heuristic_config(problem, UnifiedAttentionConfig), decode_launch=True)
    run = jax.jit(lambda a: ejkernel.unified_attention(**a, platform="triton", cfg=cfg))
    ours = run(b)
    ref = jax.jit(lambda a: ejkernel.unified_attention(**a, platform="xla"))(b)
    assert bool(jnp.all(jnp.isfinite(ours)))
    assert _rel(ours, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_serving_shape() -> None:
    """Decode, B 32 over 8k contexts (split-K by the heuristic), against XLA."""
    b = _serving_batch([8192] * 32, [1] * 32)
    args = {n: b[n] for n in ("key_cache", "value_cache", "kv_lens", "block_tables")}
    run = jax.jit(lambda q, a, p: ejkernel.page_attention(q, **a, platform=p), static_argnums=2)
    ours = run(b["queries"], args, "triton")
    ref = run(b["queries"], args, "xla")
    assert bool(jnp.all(jnp.isfinite(ours)))
    assert _rel(ours, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_mixed_batch_serving_shape() -> None:
    """12 decode tokens and 4 prefill chunks of 512 over 2k-4k contexts, against XLA."""
    rng = np.random.default_rng(1)
    kv_lens = [int(n) for n in rng.integers(2048, 4097, 16)]
    q_lens = [1] * 12 + [512] * 4
    b = _serving_batch(kv_lens, q_lens, seed=1)
    run = jax.jit(
        lambda a, p: ejkernel.ragged_page_attention(**a, num_seqs=16, platform=p),
        static_argnums=1,
    )
    ours, ref = run(b, "triton"), run(b, "xla")
    assert bool(jnp.all(jnp.isfinite(ours)))
    assert _rel(ours, ref) < 1e-2


# -- what a GPU would run (compiled for sm_90 on any machine) --------------------------------


@pytest.mark.parametrize(
    ("tokens", "rows", "max_pages", "kw"),
    [
        (32, 32, 512, {"decode": True}),
        (32, 32, 512, {}),
        (2060, 16, 256, {}),
        (4, 4, 64, {"d": 80, "hq": 8, "hkv": 2, "sinks": True, "alibi": True}),
        (8, 8, 64, {"page_size": 64, "logits_soft_cap": 3.0, "sliding_window": (100, 0)}),
    ],
    ids=["decode-b32-8k", "packed-b32-8k", "mixed", "d80-sinks-alibi", "page64-cap-window"],
)
def test_kernel_compiles_for_hopper(
    hopper_compile: None, tokens: int, rows: int, max_pages: int, kw: dict[str, Any]
) -> None:
    """The heuristic's launch compiles for sm_90: tile loads are 16-byte pipelined copies
    (no 2-byte loads), matrix instructions, shared memory within the H100's."""
    d, hq, hkv, page = kw.pop("d", 128), kw.pop("hq", 32), kw.pop("hkv", 8), kw.pop("page_size", 16)
    if kw.pop("sinks", False):
        kw["softmax_aux"] = jnp.zeros((hq,), jnp.float32)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = jnp.ones((hq,), jnp.float32)
    cache = jnp.ones((rows * max_pages + 1, page, hkv, d), jnp.bfloat16)
    qsl = jnp.zeros((rows + 1,), jnp.int32)
    compiled = hopper_launch(
        cache, tokens=tokens, hq=hq, rows=rows, max_pages=max_pages, query_start_loc=qsl, **kw
    )
    assert_pipelined_matrix_code(compiled)
    assert compiled.shared <= 232448


@pytest.mark.gpu
def test_gpu_unified_features_serving_shape() -> None:
    """Sinks, a window, a soft cap and ALiBi on a mixed batch (8 decodes, 2 chunks of 256 over
    1k-4k contexts), against XLA."""
    rng = np.random.default_rng(2)
    kv_lens = [int(n) for n in rng.integers(1024, 4097, 10)]
    b = _serving_batch(kv_lens, [1] * 8 + [256] * 2, seed=2)
    arrays = {
        "softmax_aux": jax.random.normal(jax.random.PRNGKey(5), (32,)),
        "alibi_slopes": 2.0 ** -jnp.linspace(1, 8, 32),
    }
    statics = {"sliding_window": (512, 0), "logits_soft_cap": 30.0}
    run = jax.jit(
        lambda a, o, p: ejkernel.unified_attention(**a, **o, **statics, platform=p),
        static_argnums=2,
    )
    ours, ref = run(b, arrays, "triton"), run(b, arrays, "xla")
    assert bool(jnp.all(jnp.isfinite(ours)))
    assert _rel(ours, ref) < 1e-2
