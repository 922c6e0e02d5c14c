"""Batch tuning: 8 recorded flash-attention shapes tuned one after another vs in parallel.

The figure: tuning a recorded batch of 8 flash-attention shapes with ``max_workers`` >= 4 takes
<= 0.5x the time of tuning them one after another (``max_workers=1``). Candidates compile in
parallel (worker processes on a GPU, as ``autotune_recorded`` defaults to there, and threads of
the tuning process for comparison); timings stay serial, so the ratio is what parallel
compilation saves.

Each mode runs in a fresh process with fresh caches (ejkernel's config cache and Triton
kernel folder, Triton's own cache, no JAX compilation cache), so neither reuses the other's
compiles. The wall time is that of ``autotune_recorded`` alone (not the process start).

GPU (default where JAX sees one): bf16 shapes of BENCHMARKS.md, forward (``--grad``:
forward+backward), every runnable platform (``--platforms``). CPU (``--small``): small float32
shapes on the platform each call selects, to check the harness runs.

Run: ``python benchmarks/bench_autotune_batch.py [--small] [--grad] [--platforms all|p1,p2]
[--workers 8]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: (B, S, Hq, Hkv, D, causal): the attention shapes of BENCHMARKS.md (training sweep, long
#: context, GQA Llama, D 256).
GPU_SHAPES = [
    (4, 4096, 16, 16, 128, False),
    (4, 4096, 16, 16, 128, True),
    (8, 2048, 16, 16, 64, False),
    (8, 2048, 16, 16, 64, True),
    (1, 16384, 16, 16, 128, False),
    (1, 16384, 16, 16, 128, True),
    (2, 4096, 32, 8, 128, True),
    (2, 8192, 8, 8, 256, True),
]
SMALL_SHAPES = [
    (1, s, h, h, d, causal)
    for s, h, d in ((256, 2, 16), (384, 2, 16), (256, 4, 8), (512, 1, 16))
    for causal in (False, True)
]


def records(shapes: list[tuple[int, ...]], dtype: str, grad: bool) -> list[object]:
    from ejkernel.ops import ArraySpec, RecordedInvocation

    out = []
    for b, s, hq, hkv, d, causal in shapes:
        q = ArraySpec(shape=(b, s, hq, d), dtype=dtype)
        kv = ArraySpec(shape=(b, s, hkv, d), dtype=dtype)
        out.append(
            RecordedInvocation(
                op="flash_attention",
                arrays={"query": q, "key": kv, "value": kv},
                static={"causal": causal},
                grad=grad,
            )
        )
    return out


def worker(args: argparse.Namespace) -> None:
    """One mode, in this (fresh) process: print a JSON line with the wall time."""
    if args.small:
        import jax

        jax.config.update("jax_disable_most_optimizations", True)
    from ejkernel.ops import ConfigCache, ConfigSelectorChain, Executor, autotune_recorded

    batch = records(
        SMALL_SHAPES if args.small else GPU_SHAPES,
        "float32" if args.small else "bfloat16",
        args.grad,
    )
    executor = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    start = time.perf_counter()
    result = autotune_recorded(
        batch,
        platforms=args.platforms,
        max_workers=args.worker,
        compile_processes=False if args.threads else None,
        executor=executor,
        progress=False,
        apply=False,
    )
    wall = time.perf_counter() - start
    candidates = sum(len(c.timings_ms) for c in result)
    print(
        json.dumps(
            {
                "workers": args.worker,
                "threads": args.threads,
                "wall_s": wall,
                "configs": len(result),
                "candidates_timed": candidates,
                "fastest_platforms": [c.platform for c in result.platforms.values()],
                "failures": [str(f) for f in result.failures],
            }
        )
    )


def run_mode(args: argparse.Namespace, workers: int, threads: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            EJKERNEL_CACHE_DIR=os.path.join(tmp, "ejkernel"),
            TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
        )
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        cmd = [sys.executable, __file__, "--worker", str(workers)] + ["--threads"] * threads
        cmd += ["--small"] * args.small + ["--grad"] * args.grad
        if args.platforms:
            cmd += ["--platforms", args.platforms]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"mode max_workers={workers} failed:\n{done.stderr}")
        mode = json.loads(done.stdout.strip().splitlines()[-1])
        phases = ("autotune_recorded: compiled", "autotune_recorded: timed")
        mode["phases"] = [ln for ln in done.stderr.splitlines() if any(p in ln for p in phases)]
        return mode  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="small float32 shapes (CPU)")
    parser.add_argument("--grad", action="store_true", help="tune forward+backward")
    parser.add_argument(
        "--platforms",
        default=None,
        help="'all' or p1,p2 (default: 'all' on a GPU, the selected platform with --small)",
    )
    parser.add_argument("--workers", type=int, default=8, help="threads of the parallel mode")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--processes-only", action="store_true", help="only the worker-process mode (no ratio)"
    )
    args = parser.parse_args()
    if args.platforms is None and not args.small:
        args.platforms = "all"
    if args.worker is not None:
        worker(args)
        return
    import jax

    if args.processes_only:
        mode = run_mode(args, args.workers, threads=False)
        print(f"max_workers={args.workers}: {mode['wall_s']:.1f} s, {mode['failures']}")
        print("\n".join(f"  {line}" for line in mode["phases"]))  # type: ignore[attr-defined]
        return
    serial = run_mode(args, 1, threads=True)
    parallel = run_mode(args, args.workers, threads=False)
    threaded = run_mode(args, args.workers, threads=True)
    shapes = SMALL_SHAPES if args.small else GPU_SHAPES
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; "
        f"{len(shapes)} flash_attention records, {'fwd+bwd' if args.grad else 'fwd'}, "
        f"platforms {args.platforms or 'selected'}"
    )
    for mode in (serial, parallel, threaded):
        print(
            f"max_workers={mode['workers']}{' (threads)' * bool(mode['threads'])}: "
            f"{mode['wall_s']:.1f} s, {mode['configs']} configs, "
            f"{mode['candidates_timed']} candidates timed, {len(mode['failures'])} failures, "  # type: ignore[arg-type]
            f"fastest platforms {mode['fastest_platforms'] or '-'}"
        )
        for line in mode["phases"]:  # type: ignore[attr-defined]
            print(f"  {line}")
        for failure in mode["failures"]:  # type: ignore[attr-defined]
            print(f"  {failure}")
    ratio = parallel["wall_s"] / serial["wall_s"]  # type: ignore[operator]
    print(f"ratio parallel/serial: {ratio:.2f} (target <= 0.5 with max_workers >= 4)")
    ratio = threaded["wall_s"] / serial["wall_s"]  # type: ignore[operator]
    print(f"ratio with threads/serial: {ratio:.2f}")


if __name__ == "__main__":
    main()
