"""The CUDA plugin's native kernels against their anchors on one GPU, in one run.

Measures (bf16 unless stated, BENCHMARKS.md's method: random normal inputs, warm-up and
compile first, median of several timed batches, correctness checked in the same run):

1. the ceiling: a scale-copy of 1 GiB (``y = 2·x``), GB/s of read + write;
2. decode, B 32, 8192 cached tokens, 32/8 heads, D 128 (1 GiB of K/V), GB/s of K/V read:
   ``ragged_decode_attention`` on cuda (the heuristic's split count, and the best of a small
   sweep), cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")`` with one query
   token), XLA's ``dot_product_attention``, and the XLA plugin's ragged decode;
3. paged decode, the same tokens in 16-token pages (shuffled page ids): ``page_attention``;
4. ``mean_pooling`` of ``[64, 4096, 4096]`` (2 GiB), GB/s of input read: cuda vs ``jnp.mean``.

Run (GPU machine): ``python benchmarks/bench_cuda.py [--quick]``. Prints one line per
measurement as it goes, then a markdown table with each figure against the copy ceiling and
cuDNN. Exits non-zero when a result is wrong (never counts a fast wrong kernel).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import _common
import jax
import jax.numpy as jnp
import numpy as np

GiB = 1 << 30

ROWS: list[dict[str, Any]] = []
FAILURES: list[str] = []


def timed(fn: Callable[..., Any], *args: Any, iters: int = 20) -> float:
    """Median seconds per call (BENCHMARKS.md's method: compiled first, then timed batches)."""
    return _common.timed(fn, *args, iters=iters) / 1e3


def record(group: str, name: str, seconds: float, nbytes: int, note: str = "") -> None:
    gbs = nbytes / seconds / 1e9
    ROWS.append({"group": group, "name": name, "ms": seconds * 1e3, "gbs": gbs, "note": note})
    print(f"  {group:<12} {name:<44} {seconds * 1e3:8.3f} ms  {gbs:8.0f} GB/s  {note}", flush=True)


def attempt(group: str, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as err:
        msg = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        ROWS.append(
            {"group": group, "name": name, "ms": None, "gbs": None, "note": f"failed: {msg}"}
        )
        print(f"  {group:<12} {name:<44} failed: {msg}", flush=True)
        if "--verbose" in sys.argv:
            traceback.print_exc()


def check(name: str, actual: Any, expected: Any, tol: float) -> str:
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    err = float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-6))
    ok = np.all(np.isfinite(a)) and err <= tol
    if not ok:
        FAILURES.append(f"{name}: relative error {err:.3g} > {tol}")
    return f"rel err {err:.1e}{'' if ok else ' WRONG'}"


def measure(
    group: str,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nbytes: int,
    expected: Any,
    tol: float,
    *,
    iters: int = 20,
    pick: Callable[[Any], Any] = lambda out: out,
) -> None:
    """One row: ``pick(fn(*args))`` checked against ``expected``, then ``fn`` timed; a failure
    is recorded as the row."""

    def run() -> None:
        note = check(f"{group} {name}", pick(fn(*args)), expected, tol)
        record(group, name, timed(fn, *args, iters=iters), nbytes, note)

    attempt(group, name, run)


def normal(key: int, shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


# -- 1. copy ceiling ----------------------------------------------------------------------------


def bench_copy() -> float:
    x = normal(0, (GiB // 2,), jnp.bfloat16)  # 1 GiB
    scale = jax.jit(lambda x: x * jnp.bfloat16(2))
    seconds = timed(scale, x)
    record("ceiling", "scale-copy 1 GiB (read + write)", seconds, 2 * GiB)
    del x
    return 2 * GiB / seconds / 1e9


# -- 2./3. decode ---------------------------------------------------------------------------------


def bench_decode(quick: bool) -> None:
    import ejkernel
    from ejkernel.specs.page_attention import page_attention_reference
    from ejkernel.specs.ragged_decode_attention import ragged_decode_attention_reference
    from ejkernel_cuda.ops.page_attention import PageAttentionConfig
    from ejkernel_cuda.ops.ragged_decode_attention import RaggedDecodeAttentionConfig

    b, sk, hq, hkv, d, page = 32, 8192, 32, 8, 128, 16
    q = normal(1, (b, hq, d))
    k = normal(2, (b, sk, hkv, d))
    v = normal(3, (b, sk, hkv, d))
    kv_bytes = 2 * b * sk * hkv * d * 2
    start = jnp.zeros((b,), jnp.int32)
    end = jnp.full((b,), sk, jnp.int32)
    rows = 4  # the f32 oracle on a few rows (its repeat to Hq heads is large)
    with jax.default_matmul_precision("highest"):
        expected = ragged_decode_attention_reference(
            q[:rows], k[:rows], v[:rows], start[:rows], end[:rows]
        )

    first_rows = lambda out: out[:rows]

    def decode(name: str, platform: str, cfg: Any = None, iters: int = 20) -> None:
        fn = jax.jit(
            lambda q, k, v, s, e: ejkernel.ragged_decode_attention(
                q, k, v, s, e, platform=platform, cfg=cfg
            )
        )
        args = (q, k, v, start, end)
        measure("decode", name, fn, args, kv_bytes, expected, 2e-2, iters=iters, pick=first_rows)

    selection = ejkernel.explain("ragged_decode_attention", q, k, v, start, end, platform="cuda")
    print(f"  decode heuristic config: {selection.config}", flush=True)
    decode("cuda ragged_decode (heuristic)", "cuda")
    if not quick:
        for splits in (1, 2, 3, 4, 5, 6, 8, 16):
            cfg = RaggedDecodeAttentionConfig(num_splits=splits)
            decode(f"cuda ragged_decode (num_splits={splits})", "cuda", cfg)

    q4 = q[:, None]  # [B, 1, Hq, D]
    for impl in ("cudnn", "xla"):
        fn = jax.jit(
            lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, implementation=impl)
        )
        measure(
            "decode",
            f"jax.nn.dot_product_attention[{impl}]",
            fn,
            (q4, k, v),
            kv_bytes,
            expected,
            2e-2,
            pick=lambda out: out[:rows, 0],
        )
    if not quick:
        decode("ejkernel xla ragged_decode", "xla", iters=5)

    # Paged: the same tokens in 16-token pages with shuffled ids.
    pages_per_seq = sk // page
    perm = np.random.default_rng(0).permutation(b * pages_per_seq).astype(np.int32)
    tables = jnp.asarray(perm.reshape(b, pages_per_seq))
    k_cache = (
        jnp.zeros((b * pages_per_seq, page, hkv, d), k.dtype)
        .at[tables.reshape(-1)]
        .set(k.reshape(b * pages_per_seq, page, hkv, d))
    )
    v_cache = (
        jnp.zeros_like(k_cache)
        .at[tables.reshape(-1)]
        .set(v.reshape(b * pages_per_seq, page, hkv, d))
    )
    kv_lens = jnp.full((b,), sk, jnp.int32)
    with jax.default_matmul_precision("highest"):
        expected_paged = page_attention_reference(
            q[:rows], k_cache, v_cache, kv_lens[:rows], tables[:rows]
        )

    configs = [("heuristic", None)]
    if not quick:
        configs += [(f"num_splits={n}", PageAttentionConfig(num_splits=n)) for n in (1, 2, 4, 8)]
    for label, cfg in configs:
        fn = jax.jit(
            lambda q, kc, vc, n, t, cfg=cfg: ejkernel.page_attention(
                q, kc, vc, n, t, platform="cuda", cfg=cfg
            )
        )
        measure(
            "paged",
            f"cuda page_attention page {page} ({label})",
            fn,
            (q, k_cache, v_cache, kv_lens, tables),
            kv_bytes,
            expected_paged,
            2e-2,
            pick=first_rows,
        )


# -- 4. mean pooling ----------------------------------------------------------------------------


def bench_mean_pooling() -> None:
    import ejkernel

    x = normal(4, (64, 4096, 4096))  # 2 GiB
    nbytes = x.size * 2
    expected = jnp.mean(x.astype(jnp.float32), axis=1)

    ours = jax.jit(lambda x: ejkernel.mean_pooling(x, platform="cuda"))
    measure("mean_pool", "cuda mean_pooling [64,4096,4096]", ours, (x,), nbytes, expected, 1e-2)
    xla = jax.jit(lambda x: jnp.mean(x, axis=1, dtype=jnp.float32).astype(x.dtype))
    measure("mean_pool", "jnp.mean (XLA)", xla, (x,), nbytes, expected, 1e-2)

    g = normal(5, (64, 4096))
    backward = jax.jit(
        jax.grad(
            lambda x: jnp.sum(ejkernel.mean_pooling(x, platform="cuda").astype(jnp.float32) * g)
        )
    )
    # The gradient of a mean does not depend on x, so XLA drops the forward call as dead
    # code: what runs is the backward kernel alone, writing dx (2 GiB) from g (0.5 MiB).
    measure(
        "mean_pool",
        "cuda mean_pooling grad (bwd only: write 2 GiB)",
        backward,
        (x,),
        nbytes,
        jnp.broadcast_to((g / 4096)[:, None], (64, 3, 4096)),
        1e-2,
        iters=10,
        pick=lambda dx: dx[:, :3],
    )


# -- report ---------------------------------------------------------------------------------------


def table(copy_gbs: float | None) -> str:
    cudnn = next((r["gbs"] for r in ROWS if r["name"].endswith("[cudnn]") and r["gbs"]), None)
    lines = [
        "| group | what | ms | GB/s | % of copy | × cuDNN decode | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        if r["gbs"] is None:
            lines.append(f"| {r['group']} | {r['name']} | | | | | {r['note']} |")
            continue
        pct = f"{100 * r['gbs'] / copy_gbs:.0f} %" if copy_gbs else ""
        ratio = f"{r['gbs'] / cudnn:.2f}" if cudnn and r["group"] in ("decode", "paged") else ""
        lines.append(
            f"| {r['group']} | {r['name']} | {r['ms']:.3f} | {r['gbs']:.0f} | {pct} | {ratio} | {r['note']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="skip the split sweeps and the XLA plugin"
    )
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    parser.add_argument("--only", choices=("decode", "pool"), help="run one part only")
    args = parser.parse_args()
    # Configs from the heuristics (the sweep below shows the alternatives); no autotuning.
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    import importlib.metadata as md

    dev = jax.devices()[0]
    print(f"device {dev.device_kind}  jax {jax.__version__}  jaxlib {md.version('jaxlib')}")
    if jax.default_backend() != "gpu":
        print("bench_cuda: needs an NVIDIA GPU")
        return 2
    from ejkernel_cuda import _build

    t0 = time.perf_counter()
    status = _build.native_status()
    print(
        f"native kernels: {status} ({time.perf_counter() - t0:.1f} s, {_build.status()})",
        flush=True,
    )
    copy_gbs = None
    try:
        copy_gbs = bench_copy()
    except Exception as err:
        print(f"copy ceiling failed: {err}")
    if args.only in (None, "decode"):
        bench_decode(args.quick)
    if args.only in (None, "pool"):
        bench_mean_pooling()
    print()
    print(table(copy_gbs))
    if FAILURES:
        print("\nWRONG RESULTS:\n  " + "\n  ".join(FAILURES))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
