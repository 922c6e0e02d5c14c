"""The first call of a shape with an empty user cache: does it run what the shipped table names?

For one flash-attention forward shape, in this (fresh) process with an empty cache: what
``explain`` says the default call runs (platform, config source), the first call's wall time
(compile included) and whether anything was tuned, then the default call's steady time against
each platform forced with its shipped config, timed the same way in the same process: in
``--rounds`` rounds, each contender after 0.3 s of its own calls (the harness's warm-up: an H100
at its power limit runs a function timed right after an idle moment faster). The figure: the
default call is within 3 % of the fastest platform's time, with no tuning.

Run on the GPU, after the tables are installed:
``python benchmarks/bench_shipped.py --shape 4,4096,16,128 [--causal]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from _common import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4,4096,16,128", help="B,S,H,D")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--platforms", default="triton,pallas,cuda")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("EJKERNEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejkernel-shipped-"))

    import ejkernel

    tuned: list[str] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "autotun" in record.getMessage():
                tuned.append(record.getMessage())

    logging.getLogger("ejkernel.progress").addHandler(Spy())

    b, s, h, d = (int(x) for x in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)

    def build(platform: str | None) -> tuple[object, object]:
        kw = {"causal": args.causal} | ({"platform": platform} if platform else {})
        sel = ejkernel.explain(ejkernel.flash_attention, q, k, v, **kw)
        return jax.jit(lambda q, k, v: ejkernel.flash_attention(q, k, v, **kw)), sel

    default, sel = build(None)
    t0 = time.perf_counter()
    jax.block_until_ready(default(q, k, v))
    first = time.perf_counter() - t0
    print(
        f"{args.shape} causal={args.causal}: default call -> {sel.platform} ({sel.reason}); "
        f"config from {sel.source}; first call {first:.1f} s; tuned on the way: {len(tuned)}"
    )
    contenders = {"default": default}
    for p in args.platforms.split(","):
        try:
            f, psel = build(p)
            jax.block_until_ready(f(q, k, v))
            contenders[p] = f
            print(f"  {p:7s} config from {psel.source}")
        except Exception as err:
            print(f"  {p:7s} failed: {type(err).__name__}: {str(err)[:120]}")
    # rounds: each contender timed after 0.3 s of its own calls, in turn, round after round
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, f in contenders.items():
            runs[name].append(timed(f, q, k, v, iters=20, repeats=3, warm_s=0.3))
    ms = {name: statistics.median(r) for name, r in runs.items()}
    for name, t in ms.items():
        print(f"  {name:7s} {t:.3f} ms (median of {args.rounds} rounds)")
    others = {name: t for name, t in ms.items() if name != "default"}
    best = min(others, key=others.get)
    ratios = [
        d / min(r[i] for n, r in runs.items() if n != "default")
        for i, d in enumerate(runs["default"])
    ]
    print(
        f"  default = {ms['default'] / others[best]:.3f} x the fastest platform ({best}); "
        f"per round: {', '.join(f'{x:.3f}' for x in ratios)}"
    )


if __name__ == "__main__":
    main()
