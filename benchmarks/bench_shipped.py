"""The first call of a shape with an empty user cache: does it run what the shipped table names?

For one flash-attention forward shape, in this (fresh) process with an empty cache: what
``explain`` says the default call runs (platform, config source), the first call's wall time
(compile included) and whether anything was tuned, then the default call's steady time against
each platform forced with its shipped config, timed the same way in the same process. The
figure: the default call is within 3 % of the fastest platform's time, with no tuning.

Run on the GPU, after the tables are installed:
``python benchmarks/bench_shipped.py --shape 4,4096,16,128 [--causal]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import jax
import jax.numpy as jnp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4,4096,16,128", help="B,S,H,D")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--platforms", default="triton,pallas,cuda")
    args = parser.parse_args()
    os.environ.setdefault("EJKERNEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejkernel-shipped-"))

    import ejkernel
    from ejkernel.ops import benchmark

    tuned: list[str] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "autotun" in record.getMessage():
                tuned.append(record.getMessage())

    logging.getLogger("ejkernel.progress").addHandler(Spy())

    b, s, h, d = (int(x) for x in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)

    def run(platform: str | None) -> tuple[float, float, object]:
        kw = {"causal": args.causal} | ({"platform": platform} if platform else {})
        sel = ejkernel.explain(ejkernel.flash_attention, q, k, v, **kw)
        f = jax.jit(lambda q, k, v: ejkernel.flash_attention(q, k, v, **kw))
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, k, v))
        first = time.perf_counter() - t0
        for _ in range(20):
            jax.block_until_ready(f(q, k, v))
        ms = benchmark(f, q, k, v, num_iters=20, num_warmup=0, repeats=5)
        return first, ms, sel

    first, default_ms, sel = run(None)
    print(
        f"{args.shape} causal={args.causal}: default call -> {sel.platform} ({sel.reason}); "
        f"config from {sel.source}; first call {first:.1f} s; tuned on the way: {len(tuned)}"
    )
    times = {}
    for p in args.platforms.split(","):
        try:
            _, times[p], psel = run(p)
            print(f"  {p:7s} {times[p]:.3f} ms (config from {psel.source})")
        except Exception as err:
            print(f"  {p:7s} failed: {type(err).__name__}: {str(err)[:120]}")
    best = min(times.values())
    print(f"  default {default_ms:.3f} ms = {default_ms / best:.3f} x the fastest platform")


if __name__ == "__main__":
    main()
