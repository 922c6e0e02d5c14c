"""Serving attention: under ``jax.jit`` the time follows ``sum(kv_lens)``, not the cache size.

For ``page_attention`` (decode), ``ragged_page_attention`` (a mixed prefill + decode batch) and
``ragged_page_attention_v3`` (update + attend, caches donated), on the XLA platform:

1. the same sequences in a cache of ``num_pages`` and of ``10 × num_pages`` pages, and with a
   table 10x wider (``max_pages``): the time should not move;
2. ``kv_lens`` doubling at a fixed cache: the time should grow about linearly;
3. an anchor: a naive jitted implementation that gathers every table slot of every sequence
   (``[S, max_pages · page_size]`` keys, then one masked softmax), whose time follows the
   table width instead.

Run: ``python benchmarks/bench_serving.py [--dtype bfloat16] [--seqs 32] [--quick]``.
Prints markdown tables (median ms of jitted calls after a compile call).

``--serving xla,triton[,cuda]`` instead times the issue's serving shapes (32/8 heads, D 128,
page 16, bfloat16) on each platform named, with the K/V read rate: decode B 32 and 128 over
8k contexts (``page_attention``), decode B 1 over 128k, a mixed batch of 12 decodes and 4
prefill chunks of 512 over 2k–4k contexts and a vLLM-like step of 64 decodes and 2 chunks
of 2048 over 1k–16k (``ragged_page_attention``); a platform that cannot serve a case says
why in its cell (``default``: the usual selection; ``triton:unified`` and ``triton:pingpong``:
a mixed batch's query chunks on that Triton kernel, at its heuristic tile, and the prefill
chunk below on each; ``fp8:heuristic`` and ``fp8:words``: float8 caches (scale 0.5) on the
Triton heuristic's config, its V tiles loaded as bytes or as words, ``fp8_v_words``).
``--anchors`` adds issue 30's anchors:
the run's roofline (copy bandwidth and the bf16 matmul ceiling measured in the run), the
default selection on a float8 cache, cuDNN decode on a dense cache and JAX's Pallas GPU
``paged_attention`` and ``decode_attention`` (decode batches), vLLM's Triton
``unified_attention`` (mixed and vLLM-like batches, on torch through dlpack, timed with CUDA
events; below the table, its output's max abs difference from the default call's) and a
2048-query prefill chunk on an 8k context against flash attention's forward:
``python benchmarks/bench_serving.py --serving default,triton,cuda --anchors``. ``--parts``
adds, after each mixed batch, its decodes alone and its prefill chunks alone (where the
batch's time goes, each beside its own roofline). ``--fp8-tiles`` times the decode batches on
float8 caches at several key tiles, warps and stages (:data:`FP8_TILES`) beside the bf16
default call.

The vLLM anchor needs torch and triton and ``.whl-vllm`` on ``PYTHONPATH`` (its cell says why
otherwise): ``bash benchmarks/fetch_vllm_anchor.sh`` here writes it (vLLM 0.33's kernel module
and stand-ins, ~130 kB); the GPU call carries ``.whl`` and ``.whl-vllm`` and runs
``bash benchmarks/gpu_serving.sh`` (it copies ``.whl-vllm/vllm`` into the install folder), or
``PYTHONPATH=/tmp/site:.whl-vllm python benchmarks/bench_serving.py --serving default,triton
--anchors``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import ceilings, timed

import ejkernel
from ejkernel.specs._paged import paged_block_tables

PAGE_SIZE, HQ, HKV, D = 16, 8, 2, 64


def batch(
    kv_lens: list[int], q_lens: list[int], num_pages: int, max_pages: int, dtype: Any, seed: int = 0
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    tables = paged_block_tables(
        rng, kv_lens, num_pages=num_pages, page_size=PAGE_SIZE, max_pages=max_pages, unused=-1
    )
    cache = (num_pages, PAGE_SIZE, HKV, D)
    t = sum(q_lens)
    return {
        "queries": jnp.asarray(rng.standard_normal((t, HQ, D), np.float32), dtype),
        "keys": jnp.asarray(rng.standard_normal((t, HKV, D), np.float32), dtype),
        "values": jnp.asarray(rng.standard_normal((t, HKV, D), np.float32), dtype),
        # Random contents in a cache this large take a while to draw; any values time the same.
        "key_cache": jnp.full(cache, 0.5, dtype),
        "value_cache": jnp.full(cache, -0.25, dtype),
        "kv_lens": jnp.asarray(kv_lens, jnp.int32),
        "block_tables": jnp.asarray(tables),
        "query_start_loc": jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    }


def naive_decode(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
) -> jax.Array:
    """The anchor: gather every table slot of every sequence, then one masked softmax."""
    s, max_pages = block_tables.shape
    ids = jnp.clip(block_tables, 0, key_cache.shape[0] - 1)
    k = key_cache[ids].reshape(s, max_pages * PAGE_SIZE, HKV, D)
    v = value_cache[ids].reshape(s, max_pages * PAGE_SIZE, HKV, D)
    q = query.reshape(s, HKV, HQ // HKV, D)
    logits = jnp.einsum("shgd,skhd->shgk", q, k, preferred_element_type=jnp.float32) * D**-0.5
    visible = jnp.arange(max_pages * PAGE_SIZE)[None, None, None, :] < kv_lens[:, None, None, None]
    p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    return jnp.einsum("shgk,skhd->shgd", p.astype(v.dtype), v).reshape(s, HQ, D).astype(query.dtype)


def decode_fns() -> dict[str, Callable[..., Any]]:
    ours = lambda b: ejkernel.page_attention(
        b["queries"],
        b["key_cache"],
        b["value_cache"],
        b["kv_lens"],
        b["block_tables"],
        platform="xla",
    )
    naive = lambda b: naive_decode(
        b["queries"], b["key_cache"], b["value_cache"], b["kv_lens"], b["block_tables"]
    )
    return {"page_attention": jax.jit(ours), "naive gather-all": jax.jit(naive)}


def ragged_fn(b: dict[str, Any]) -> jax.Array:
    args = (
        b["queries"],
        b["key_cache"],
        b["value_cache"],
        b["kv_lens"],
        b["block_tables"],
        b["query_start_loc"],
    )
    return ejkernel.ragged_page_attention(*args, len(b["kv_lens"]), platform="xla")


def v3_step() -> Callable[..., Any]:
    def step(q: Any, k: Any, v: Any, kc: Any, vc: Any, kv_lens: Any, tables: Any, qsl: Any) -> Any:
        return ejkernel.ragged_page_attention_v3(
            q, k, v, kc, vc, kv_lens, tables, qsl, kv_lens.shape[0], platform="xla"
        )

    return jax.jit(step, donate_argnums=(3, 4))


def time_v3(b: dict[str, Any]) -> float:
    """Median ms of the donated update + attention, threading the caches through the calls."""
    step = v3_step()
    state = {"kc": b["key_cache"], "vc": b["value_cache"]}
    rest = (b["kv_lens"], b["block_tables"], b["query_start_loc"])

    def call() -> Any:
        out, state["kc"], state["vc"] = step(
            b["queries"], b["keys"], b["values"], state["kc"], state["vc"], *rest
        )
        return out

    return timed(call)


def mixed_lengths(seqs: int, decode_len: int) -> tuple[list[int], list[int]]:
    """One 512-token prefill chunk of a 2·decode_len sequence, the rest decode steps."""
    kv_lens = [2 * decode_len] + [decode_len] * (seqs - 1)
    q_lens = [512] + [1] * (seqs - 1)
    return kv_lens, q_lens


def serving_cases(quick: bool, parts: bool = False) -> list[tuple[str, list[int], list[int]]]:
    """The serving shapes as ``(name, kv_lens, q_lens)``; ``quick``: contexts and chunks / 8;
    ``parts``: after each mixed batch, its decodes alone and its chunks alone."""
    rng = np.random.default_rng(0)
    scale = 8 if quick else 1
    mixed = [int(n) for n in rng.integers(2048, 4097, 16) // scale]
    vllm = [int(n) for n in rng.integers(1024, 16385, 66) // scale]
    cases = [
        ("decode B32 8k", [8192 // scale] * 32, [1] * 32),
        ("decode B128 8k", [8192 // scale] * 128, [1] * 128),
        ("decode B1 128k", [131072 // scale], [1]),
        ("mixed 12 dec + 4x512", mixed, [1] * 12 + [512 // scale] * 4),
        ("vllm-like 64 dec + 2x2048", vllm, [1] * 64 + [2048 // scale] * 2),
    ]
    if not parts:
        return cases
    out = []
    for name, kv_lens, q_lens in cases:
        out.append((name, kv_lens, q_lens))
        if len(set(q_lens)) > 1:  # a mixed batch
            for part, keep in (("its decodes", lambda q: q == 1), ("its chunks", lambda q: q > 1)):
                idx = [i for i, q in enumerate(q_lens) if keep(q)]
                kv, q = [kv_lens[i] for i in idx], [q_lens[i] for i in idx]
                out.append((f"{name.split()[0]}: {part}", kv, q))
    return out


def _causal_flops(kv_lens: list[int], q_lens: list[int], hq: int, d: int) -> int:
    """Attention flops of a ragged batch whose queries are their sequences' last tokens."""
    pairs = sum(q * k - q * (q - 1) // 2 for q, k in zip(q_lens, kv_lens, strict=True))
    return 4 * pairs * hq * d


def chunk_config(kernel: str, q: Any, kc: Any, rows: int, max_pages: int, config: Any) -> Any:
    """The Triton serving config of ``config``'s class whose query chunks run on ``kernel``
    (``unified``: the heuristic's tiles without the ping-pong kernel; ``pingpong``: its tile)."""
    from ejkernel_triton.ops.unified_attention_config import (
        PINGPONG_TILE,
        Problem,
        heuristic_config,
    )

    if kernel == "pingpong":
        return config(fwd_params=PINGPONG_TILE, num_splits=1, chunk_kernel="pingpong")
    return heuristic_config(Problem.of(q, kc, rows, max_pages), config)


def _ours(c: dict[str, Any], platform: str | None, **scales: Any) -> tuple[Any, tuple]:
    """``page_attention`` for a decode batch (one query each), else ``ragged_page_attention``;
    ``platform`` ``triton:<chunk kernel>`` runs a mixed batch's chunks on that kernel."""
    cfg = None
    if platform and platform.startswith("fp8:"):  # the Triton heuristic's config on fp8 caches
        import attrs

        from ejkernel_triton.ops import page_attention, ragged_page_attention

        decode = c["q"].shape[0] == c["lens"].shape[0]
        kwargs = {"query" if decode else "queries": c["q"], "key_cache": c["kc"]}
        kwargs |= {"value_cache": c["vc"], "kv_lens": c["lens"], "block_tables": c["table"]}
        kwargs |= scales
        if not decode:
            kwargs |= {"query_start_loc": c["qsl"], "num_seqs": c["lens"].shape[0]}
        op = page_attention if decode else ragged_page_attention
        cfg = op.heuristic(types.SimpleNamespace(kwargs=kwargs))
        cfg = attrs.evolve(cfg, fp8_v_words=platform == "fp8:words")
        platform = "triton"
    if platform and ":" in platform:
        from ejkernel_triton.ops.ragged_page_attention import RaggedPageAttentionConfig

        if c["q"].shape[0] == c["lens"].shape[0]:
            raise ValueError("a decode batch has no chunks")
        platform, kernel = platform.split(":")
        cfg = chunk_config(kernel, c["q"], c["kc"], *c["table"].shape, RaggedPageAttentionConfig)
    if c["q"].shape[0] == c["lens"].shape[0]:
        return _decode_at((c["q"], c["kc"], c["vc"], c["lens"], c["table"]), cfg, scales, platform)
    fn = jax.jit(
        lambda q, kc, vc, n, t, s: ejkernel.ragged_page_attention(
            q, kc, vc, n, t, s, n.shape[0], platform=platform, cfg=cfg, **scales
        )
    )
    return fn, (c["q"], c["kc"], c["vc"], c["lens"], c["table"], c["qsl"])


def _chosen(c: dict[str, Any], **scales: Any) -> str:
    """What the default call of :func:`_ours` runs: platform, config and where it came from."""
    decode = c["q"].shape[0] == c["lens"].shape[0]
    args = (c["q"], c["kc"], c["vc"], c["lens"], c["table"])
    try:
        if decode:
            rec = ejkernel.explain("page_attention", *args, **scales)
        else:
            n = c["lens"].shape[0]
            rec = ejkernel.explain("ragged_page_attention", *args, c["qsl"], n, **scales)
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return f"{rec.platform} ({rec.reason}; {rec.source}) {rec.config}"


def _anchor(c: dict[str, Any], name: str) -> tuple[Any, tuple]:
    """A decode batch's anchor on the same inputs: cuDNN decode on a dense cache (one query
    token), or JAX's Pallas GPU kernels, paged (``[Hkv, pages, page, D]`` caches) and dense."""
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    q, kc, vc, table, lens = c["q"], c["kc"], c["vc"], c["table"], c["lens"]
    b, hkv, d = q.shape[0], kc.shape[2], kc.shape[3]
    s = int(lens.max())
    dense_k = kc[table].reshape(b, -1, hkv, d)[:, :s]
    dense_v = vc[table].reshape(b, -1, hkv, d)[:, :s]
    if name == "cuDNN":
        fn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")
        )
        return fn, (q, dense_k, dense_v)
    if name == "pallas paged":
        pages_k, pages_v = jnp.transpose(kc, (2, 0, 1, 3)), jnp.transpose(vc, (2, 0, 1, 3))
        return jax.jit(pallas_paged.paged_attention), (q, pages_k, pages_v, table, lens)
    fn = jax.jit(lambda q, k, v, n: pallas_decode.gqa(q, k, v, kv_seq_len=n))
    return fn, (q, dense_k, dense_v, lens)


def _cell(
    make: Callable[..., tuple[Any, tuple]], *args: Any, nbytes: int, warm_s: float, **kw: Any
) -> str:
    """``ms (GB/s)`` of the function ``make(*args, **kw)`` builds, or why it cannot run."""
    try:
        fn, call = make(*args, **kw)
        ms = timed(fn, *call, warm_s=warm_s)
    except Exception as err:  # a contender that cannot serve the case says why
        return f"n/a: {type(err).__name__}: {str(err).splitlines()[0][:60]}"
    return f"{ms:.3f} ({nbytes / ms / 1e6:.0f})"


def _vllm_call(c: dict[str, Any]) -> Callable[[], Any]:
    """vLLM's Triton ``unified_attention`` (``benchmarks/fetch_vllm_anchor.sh``) on the case's
    arrays, shared through dlpack in its layouts: queries ``[T, Hq, D]``, caches
    ``[pages, page, Hkv, D]``, ``cu_seqlens_q``, ``seqused_k`` and a block table whose unused
    slots are page 0 (padded by 8 pages: its kernel reads whole key tiles of table entries)."""
    import torch
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    if not os.environ.get("TRITON_CACHE_DIR"):  # jax-triton leaves it empty
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-vllm-triton-")
    table = jnp.pad(jnp.maximum(c["table"], 0), ((0, 0), (0, 8)))
    arrays = jax.block_until_ready([c["q"], c["kc"], c["vc"], c["qsl"], c["lens"], table])
    q, kc, vc, qsl, lens, table = (torch.from_dlpack(a) for a in arrays)
    out = torch.empty_like(q)
    kw = {
        "max_seqlen_q": int(np.diff(np.asarray(c["qsl"])).max()),
        "max_seqlen_k": int(np.asarray(c["lens"]).max()),
        "softmax_scale": q.shape[-1] ** -0.5,
        "causal": True,
        "window_size": (-1, -1),
        "softcap": 0,
        "q_descale": None,
        "k_descale": None,
        "v_descale": None,
    }

    def call() -> Any:
        unified_attention(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=qsl, seqused_k=lens, block_table=table, **kw
        )
        return out

    return call


def _torch_timed(
    call: Callable[[], Any], warm_s: float, iters: int = 10, repeats: int = 5
) -> float:
    """Median ms per call over ``repeats`` batches of ``iters``, timed with CUDA events after
    one call and ``warm_s`` seconds of calls."""
    import torch

    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        call()
        torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        runs.append(begin.elapsed_time(end) / iters)
    return statistics.median(runs)


def _vllm_cell(c: dict[str, Any], nbytes: int, warm_s: float) -> tuple[str, str]:
    """``ms (GB/s)`` of vLLM's unified attention and the max abs difference of its output from
    the default call's, or why it cannot run."""
    try:
        call = _vllm_call(c)
        ms = _torch_timed(call, warm_s)
    except Exception as err:  # no .whl-vllm, or a kernel that cannot serve the case
        return f"n/a: {type(err).__name__}: {str(err).splitlines()[0][:60]}", "not run"
    fn, args = _ours(c, None)
    ours = np.asarray(fn(*args), np.float32)
    theirs = np.asarray(call().float().cpu())
    return f"{ms:.3f} ({nbytes / ms / 1e6:.0f})", f"{np.abs(theirs - ours).max():.2e}"


def _case_arrays(
    kv_lens: list[int], q_lens: list[int], page: int, hq: int, hkv: int, d: int
) -> tuple[dict[str, Any], int]:
    """A serving case's arrays (bf16 queries and caches, shuffled tables, ``query_start_loc``)
    and the bytes of K and V its sequences hold."""
    rng = np.random.default_rng(1)
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = sum(-(-n // page) for n in kv_lens) + 8
    tables = paged_block_tables(
        rng, kv_lens, num_pages=num_pages, page_size=page, max_pages=max_pages, unused=-1
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (sum(q_lens), hq, d), jnp.bfloat16)
    kc = jax.random.normal(keys[1], (num_pages, page, hkv, d), jnp.bfloat16)
    vc = jax.random.normal(keys[2], (num_pages, page, hkv, d), jnp.bfloat16)
    lens, table = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    call = {"q": q, "kc": kc, "vc": vc, "lens": lens, "table": table, "qsl": qsl}
    return call, sum(kv_lens) * hkv * d * 2 * 2


def _decode_at(
    args: tuple, cfg: Any, scales: dict[str, Any], platform: str | None = "triton"
) -> tuple[Any, tuple]:
    """``page_attention`` on ``platform`` (``None``: the usual selection) at ``cfg`` (``None``:
    the selection's) on ``args`` (query, caches, lengths, table)."""
    fn = jax.jit(
        lambda q, kc, vc, n, t: ejkernel.page_attention(
            q, kc, vc, n, t, platform=platform, cfg=cfg, **scales
        )
    )
    return fn, args


#: The decode tiles ``--fp8-tiles`` times on float8 caches: (keys, warps, stages).
FP8_TILES = ((128, 4, 2), (128, 4, 3), (256, 4, 2), (256, 8, 2), (256, 4, 3), (64, 4, 4))


def fp8_tiles(quick: bool) -> None:
    """``--fp8-tiles``: each decode case's ``page_attention`` on float8 caches (scale 0.5,
    V loaded as words) at the Triton heuristic's rows and splits and each of
    :data:`FP8_TILES`, beside the bf16 default call: ms (GB/s of the bytes read)."""
    import attrs

    from ejkernel_triton.ops import page_attention

    page, hq, hkv, d = 16, 32, 8, 128
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; fp8 decode tiles")
    cases = [c for c in serving_cases(quick) if all(n == 1 for n in c[2])]
    head = " | ".join(f"fp8 {k} keys w{w} s{st}" for k, w, st in FP8_TILES)
    print(f"\n| case | bf16 default | {head} |")
    print("|---|---|" + "---|" * len(FP8_TILES))
    for name, kv_lens, q_lens in cases:
        call, kv_bytes = _case_arrays(kv_lens, q_lens, page, hq, hkv, d)
        cells = [_cell(_ours, call, None, nbytes=kv_bytes, warm_s=0.2)]
        f8 = {
            "kc": call["kc"].astype(jnp.float8_e4m3fn),
            "vc": call["vc"].astype(jnp.float8_e4m3fn),
        }
        scales = {"k_scale": 0.5, "v_scale": 0.5}
        kw = {"query": call["q"], "key_cache": f8["kc"], "value_cache": f8["vc"]}
        kw |= {"kv_lens": call["lens"], "block_tables": call["table"], **scales}
        base = page_attention.heuristic(types.SimpleNamespace(kwargs=kw))
        args = (call["q"], f8["kc"], f8["vc"], call["lens"], call["table"])
        for keys, warps, stages in FP8_TILES:
            params = attrs.evolve(
                base.fwd_params, kv_blocksize=keys, num_warps=warps, num_stages=stages
            )
            cfg = attrs.evolve(base, fwd_params=params)
            cells.append(_cell(_decode_at, args, cfg, scales, nbytes=kv_bytes // 2, warm_s=0.2))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        print(f"  (heuristic: {base})", flush=True)


def serving(platforms: list[str], quick: bool, anchors: bool, parts: bool = False) -> None:
    """Each serving shape on each platform (``default``: the usual selection): median ms and
    the K/V read rate (GB/s). With ``anchors``: the roofline of the same run (the larger of
    the K/V bytes over the copy bandwidth and the flops over the bf16 matmul ceiling), the
    default selection on a float8 cache, cuDNN decode and JAX's Pallas GPU kernels (decode
    batches), vLLM's unified attention (mixed batches), and a 2048-query prefill chunk on an
    8k context against flash attention."""
    page, hq, hkv, d = 16, 32, 8, 128
    extra = ["roofline ms", "default fp8", "cuDNN", "pallas paged", "pallas decode", "vLLM unified"]
    columns = [f"{p} ms (GB/s)" for p in platforms] + (extra if anchors else [])
    bw = peak = 0.0
    if anchors:
        bw, peak = ceilings(1 << 30, 8192 // (8 if quick else 1))
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; Hq={hq}, Hkv={hkv}, "
        f"D={d}, page {page}, bf16"
        + (f"; copy {bw:.0f} GB/s, matmul {peak:.0f} TFLOP/s" if anchors else "")
    )
    print("\n| case | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    chosen: list[str] = []
    checks: list[str] = []
    for name, kv_lens, q_lens in serving_cases(quick, parts):
        call, kv_bytes = _case_arrays(kv_lens, q_lens, page, hq, hkv, d)
        kc, vc = call["kc"], call["vc"]
        warm = 0.2 if anchors else 0.0
        f8 = {"kc": kc.astype(jnp.float8_e4m3fn), "vc": vc.astype(jnp.float8_e4m3fn)}
        scales = {"k_scale": 0.5, "v_scale": 0.5}
        cells = [
            _cell(_ours, call | f8, p, nbytes=kv_bytes // 2, warm_s=warm, **scales)
            if p.startswith("fp8:")
            else _cell(_ours, call, None if p == "default" else p, nbytes=kv_bytes, warm_s=warm)
            for p in platforms
        ]
        if anchors:
            flops = _causal_flops(kv_lens, q_lens, hq, d)
            cells.append(f"{max(kv_bytes / bw / 1e6, flops / peak / 1e9):.3f}")
            cells.append(_cell(_ours, call | f8, None, nbytes=kv_bytes // 2, warm_s=warm, **scales))
            chosen.append(f"- {name}, fp8 cache: {_chosen(call | f8, **scales)}")
            decode = all(n == 1 for n in q_lens)
            for anchor in ("cuDNN", "pallas paged", "pallas decode"):
                cells.append(
                    _cell(_anchor, call, anchor, nbytes=kv_bytes, warm_s=warm) if decode else ""
                )
            vllm, diff = ("", "") if decode else _vllm_cell(call, kv_bytes, warm)
            cells.append(vllm)
            checks += [f"- {name}: {diff}"] if diff else []
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        if "default" in platforms:
            chosen.append(f"- {name}: {_chosen(call)}")
    print("\nChosen by the default call (after the timed calls):\n" + "\n".join(sorted(chosen)))
    if checks:
        print("\nvLLM unified attention, max abs difference from the default call's output:")
        print("\n".join(checks))
    if anchors or any(p.startswith("triton:") for p in platforms):
        prefill_chunk(quick, [p.split(":")[1] for p in platforms if p.startswith("triton:")])


def prefill_chunk(quick: bool, chunk_kernels: list[str]) -> None:
    """``prefill_page_attention``: a chunk of 2048 queries at the end of an 8k context, against
    flash attention's forward on the same dense shape (causal, bottom-right), in TFLOP/s; the
    default call, then on each of ``chunk_kernels``."""
    from ejkernel_triton.ops.prefill_page_attention import PrefillPageAttentionConfig

    scale = 8 if quick else 1
    page, hq, hkv, d, c, s = 16, 32, 8, 128, 2048 // scale, 8192 // scale
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    q = jax.random.normal(keys[0], (c, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (s, hkv, d), jnp.bfloat16)
    order = np.random.default_rng(3).permutation(s // page)
    kc = (
        jnp.zeros((s // page, page, hkv, d), jnp.bfloat16)
        .at[order]
        .set(k.reshape(-1, page, hkv, d))
    )
    vc = (
        jnp.zeros((s // page, page, hkv, d), jnp.bfloat16)
        .at[order]
        .set(v.reshape(-1, page, hkv, d))
    )
    flops = _causal_flops([s], [c], hq, d)

    def paged(cfg: Any) -> Any:
        return jax.jit(
            lambda q, kc, vc, p: ejkernel.prefill_page_attention(q, kc, vc, s, p, cfg=cfg)
        )

    flash = jax.jit(
        lambda q, k, v: ejkernel.flash_attention(q[None], k[None], v[None], causal=True)[0]
    )
    table = jnp.asarray(order, jnp.int32)
    rows = [("prefill_page_attention", paged(None), (q, kc, vc, table))]
    for kernel in chunk_kernels:
        cfg = chunk_config(kernel, q, kc, 1, s // page, PrefillPageAttentionConfig)
        rows.append((f"prefill_page_attention, {kernel}", paged(cfg), (q, kc, vc, table)))
    print(f"\n| prefill chunk {c} on a {s} context | ms | TFLOP/s |\n|---|---|---|")
    for label, fn, args in (*rows, ("flash_attention (dense)", flash, (q, k, v))):
        ms = timed(fn, *args, warm_s=0.2)
        print(f"| {label} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument(
        "--serving", default="", help="time the serving shapes on these platforms (or default)"
    )
    parser.add_argument("--anchors", action="store_true", help="with --serving: the anchors")
    parser.add_argument(
        "--parts", action="store_true", help="with --serving: each mixed batch's two halves too"
    )
    parser.add_argument("--fp8-tiles", action="store_true", help="fp8 decode at several tiles")
    args = parser.parse_args()
    if args.fp8_tiles:
        fp8_tiles(args.quick)
        return
    if args.serving:
        serving(args.serving.split(","), args.quick, args.anchors, args.parts)
        return
    dtype = jnp.dtype(args.dtype)
    s = args.seqs
    lengths = [128, 256, 512] if args.quick else [256, 512, 1024, 2048]
    kv = lengths[-2]
    print(
        f"device: {jax.devices()[0].device_kind}; S={s}, page_size={PAGE_SIZE}, Hq={HQ}, Hkv={HKV}, D={D}, {dtype}"
    )

    print("\n### decode (page_attention): same sequences, cache and table grown 10x\n")
    print("| impl | kv_len | sum(kv_lens) | num_pages | max_pages | ms |")
    print("|---|---|---|---|---|---|")
    fns = decode_fns()
    width = 2 * kv // PAGE_SIZE
    for num_pages, max_pages in (
        (s * width, width),
        (10 * s * width, width),
        (s * width, 10 * width),
    ):
        b = batch([kv] * s, [1] * s, num_pages, max_pages, dtype)
        for name, fn in fns.items():
            print(
                f"| {name} | {kv} | {kv * s} | {num_pages} | {max_pages} | {timed(fn, b):.2f} |",
                flush=True,
            )

    print("\n### decode (page_attention): kv_len grown in a fixed cache\n")
    print("| impl | kv_len | sum(kv_lens) | num_pages | max_pages | ms |")
    print("|---|---|---|---|---|---|")
    width = max(lengths) // PAGE_SIZE
    for n in lengths:
        b = batch([n] * s, [1] * s, s * width, width, dtype)
        for name, fn in fns.items():
            print(
                f"| {name} | {n} | {n * s} | {s * width} | {width} | {timed(fn, b):.2f} |",
                flush=True,
            )

    print(
        "\n### mixed batch: one 512-token prefill chunk + decodes; v3 = donated update + attend\n"
    )
    print("| op | decode kv_len | sum(kv_lens) | num_pages | ms |")
    print("|---|---|---|---|---|")
    ragged = jax.jit(ragged_fn)
    width = 2 * max(lengths) // PAGE_SIZE
    cases = [(kv, s * width), (kv, 10 * s * width)] + [(n, s * width) for n in lengths if n != kv]
    for n, num_pages in cases:
        kv_lens, q_lens = mixed_lengths(s, n)
        b = batch(kv_lens, q_lens, num_pages, width, dtype)
        print(
            f"| ragged_page_attention | {n} | {sum(kv_lens)} | {num_pages} | {timed(ragged, b):.2f} |",
            flush=True,
        )
        print(
            f"| ragged_page_attention_v3 | {n} | {sum(kv_lens)} | {num_pages} | {time_v3(b):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
