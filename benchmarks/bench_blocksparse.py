"""Block-sparse attention: time against live-block fraction (CPU, jit, XLA plugin).

The claim checked: at 10 % live blocks ``ejkernel.blocksparse_attention`` takes at most 0.25× the
time of the same call with every block live (its cost grows with the live blocks). Three masks
at (B, S, H, D) = (1, 5120, 8, 64) f32, blocks (128, 128), so 40 × 40 blocks per head:

- ``dense``: every block live (the baseline);
- ``balanced 10%``: each query-block row has exactly 4 of its 40 key blocks live, at random
  (per batch and head);
- ``bernoulli 10%``: each block live with probability 0.1, independently (rows differ: the
  busiest row sets the loop's trip count, see the implementation's docstring).

Forward and forward+backward (``jax.vjp``) are timed separately, median of repeats after a
compile call, with ``block_mask`` an argument of the jitted function (traced, as in training);
wall time and this process's CPU time are both reported (the latter stays meaningful on a
shared machine). Ratios are against the dense row.

Run: ``python benchmarks/bench_blocksparse.py [--seq 5120] [--heads 8] [--block 128]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ejkernel


def timed(
    fn: Callable[..., Any], *args: Any, iters: int = 2, repeats: int = 3
) -> tuple[float, float]:
    """Median (wall ms, process CPU ms) per call over ``repeats`` batches of ``iters``.

    CPU time (every thread of this process) is reported beside wall time because it stays
    meaningful on a machine shared with other work.
    """
    jax.block_until_ready(fn(*args))  # compile
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - t0) * 1e3 / iters)
        cpus.append((time.process_time() - c0) * 1e3 / iters)
    return statistics.median(walls), statistics.median(cpus)


def masks(b: int, h: int, n: int, fraction: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    per_row = max(1, round(fraction * n))
    balanced = np.zeros((b, h, n, n), bool)
    for idx in np.ndindex(b, h, n):
        balanced[idx][rng.choice(n, per_row, replace=False)] = True
    return {
        "dense": np.ones((b, h, n, n), bool),
        f"balanced {fraction:.0%}": balanced,
        f"bernoulli {fraction:.0%}": rng.random((b, h, n, n)) < fraction,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.1)
    args = parser.parse_args()
    b, s, h, d, blk = args.batch, args.seq, args.heads, args.dim, args.block
    n = -(-s // blk)
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    print(f"(B, S, H, D) = ({b}, {s}, {h}, {d}) f32, block ({blk}, {blk}), {n} x {n} blocks/head")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.float32) for key in keys)

    def attn(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return ejkernel.blocksparse_attention(
            q, k, v, block_mask=mask, block_size=(blk, blk), platform="xla"
        )

    def fwd_bwd(q: Any, k: Any, v: Any, mask: Any, do: Any) -> Any:
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, mask), q, k, v)
        return out, vjp(do)

    forward, backward = jax.jit(attn), jax.jit(fwd_bwd)
    print(
        "| mask | live blocks | max live per row | fwd ms (wall / cpu) | ratio (wall / cpu) "
        "| fwd+bwd ms (wall / cpu) | ratio (wall / cpu) |"
    )
    print("|---|---|---|---|---|---|---|")
    base: list[tuple[float, float]] = []
    for name, mask in masks(b, h, n, args.fraction).items():
        m = jnp.asarray(mask)
        times = [timed(forward, q, k, v, m), timed(backward, q, k, v, m, do)]
        base = base or times
        cells = []
        for (wall, cpu), (wall0, cpu0) in zip(times, base):
            cells += [f"{wall:.0f} / {cpu:.0f}", f"{wall / wall0:.3f} / {cpu / cpu0:.3f}"]
        print(
            f"| {name} | {mask.mean():.1%} | {mask.sum(-1).max()} | {' | '.join(cells)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
