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

GPU (``--gpu``): the Triton kernels against our dense flash attention in the same run, bf16,
(1, 8192, 16, 128), 128 × 128 blocks, masks with every block live and with 50 % and 90 % of
each query block's key blocks dead (the diagonal block always live). Per row: forward and
forward+backward ms, TFLOP/s counted on the computed blocks only (BENCHMARKS.md's convention:
``4·B·H·D·bq·bk`` a live block forward, 3.5× that forward+backward), the ratio of that to the
dense flash attention's TFLOP/s (the default call's kernels, and the usual Triton kernels'),
and the time against the all-live mask (the claim: time ∝ computed blocks). The output is
checked against flash attention (XLA platform) under the block mask expanded to a dense
attention mask, in the same run (the XLA block-sparse schedule compiles slowly at this size).
A row per kernel variant (``--variants``: ``default``, the heuristic's config, and
``warp_specialized``, the Hopper kernels of both passes).
``python benchmarks/bench_blocksparse.py --gpu [--seq 8192] [--heads 16] [--dim 128]
[--variants default,warp_specialized]``
"""

from __future__ import annotations

import argparse
import itertools
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


def balanced_mask(b: int, h: int, n: int, live: float, seed: int = 0) -> np.ndarray:
    """Each query block keeps ``round(live · n)`` key blocks: its diagonal and random others."""
    rng = np.random.default_rng(seed)
    per_row = max(1, round(live * n))
    mask = np.zeros((b, h, n, n), bool)
    for idx in np.ndindex(b, h, n):
        others = rng.choice(np.delete(np.arange(n), idx[2]), per_row - 1, replace=False)
        mask[idx][[idx[2], *others]] = True
    return mask


def gpu(b: int, s: int, h: int, d: int, blk: int, variants: list[str]) -> None:
    """The Triton kernels against dense flash attention (see the module docstring), a row per
    live fraction and kernel variant (``default``: the heuristic's config)."""
    from ejkernel_triton.ops.blocksparse_attention import BlocksparseAttentionConfig
    from ejkernel_triton.ops.flash_attention import FlashAttentionConfig

    n = -(-s // blk)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, ejkernel {ejkernel.__version__}")
    print(f"(B, S, H, D) = ({b}, {s}, {h}, {d}) bf16, blocks ({blk}, {blk}), {n} x {n} a head")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)
    dense_flops = 4 * b * h * s * s * d

    def fwd_bwd(attn: Callable[..., Any]) -> Callable[..., Any]:
        def f(q: Any, k: Any, v: Any, do: Any) -> Any:
            out, vjp = jax.vjp(attn, q, k, v)
            return out, vjp(do)

        return jax.jit(f)

    def ms(fn: Callable[..., Any], *args: Any) -> float:
        return timed(fn, *args, iters=10, repeats=5)[0]

    anchors = {}
    usual = FlashAttentionConfig()
    for name, cfg in (("flash (default)", None), ("flash (usual kernels)", usual)):
        attn = lambda q, k, v, cfg=cfg: ejkernel.flash_attention(
            q, k, v, platform="triton", cfg=cfg
        )
        fwd = ms(jax.jit(attn), q, k, v)
        both = ms(fwd_bwd(attn), q, k, v, do)
        anchors[name] = (dense_flops / fwd / 1e9, 3.5 * dense_flops / both / 1e9)
        print(
            f"{name}: fwd {fwd:.2f} ms ({anchors[name][0]:.0f} TFLOP/s), fwd+bwd {both:.2f} ms "
            f"({anchors[name][1]:.0f} TFLOP/s)"
        )
    print(
        "| live blocks | kernels | fwd ms | fwd TFLOP/s | vs flash default / usual | fwd+bwd ms "
        "| fwd+bwd TFLOP/s | vs flash default / usual | time vs all live (fwd / fwd+bwd) "
        "| rel err vs dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, tuple[float, float]] = {}
    for live, variant in itertools.product((1.0, 0.5, 0.1), variants):
        mask = jnp.asarray(balanced_mask(b, h, n, live))
        flops = 4 * d * blk * blk * int(mask.sum())  # mask: [B, H, n, n]
        cfg = None
        if variant != "default":  # the variant's kernels in both passes
            cfg = BlocksparseAttentionConfig(fwd_variant=variant, bwd_variant=variant)

        def attn(q: Any, k: Any, v: Any, mask: Any = mask, cfg: Any = cfg) -> Any:
            return ejkernel.blocksparse_attention(
                q, k, v, block_mask=mask, block_size=blk, platform="triton", cfg=cfg
            )

        fwd, both = ms(jax.jit(attn), q, k, v), ms(fwd_bwd(attn), q, k, v, do)
        base.setdefault(variant, (fwd, both))
        got = jax.jit(attn)(q, k, v).astype(jnp.float32)
        want = jax.jit(
            lambda q, k, v, m: ejkernel.flash_attention(
                q,
                k,
                v,
                attention_mask=jnp.repeat(jnp.repeat(m, blk, axis=2), blk, axis=3)[:, :, :s, :s],
                platform="xla",
            )
        )(q, k, v, mask)
        err = float(jnp.linalg.norm(got - want.astype(jnp.float32)) / jnp.linalg.norm(want))
        tf = (flops / fwd / 1e9, 3.5 * flops / both / 1e9)
        vs = [" / ".join(f"{tf[i] / a[i]:.2f}" for a in anchors.values()) for i in range(2)]
        first = base[variant]
        cells = [f"{float(mask.mean()):.0%}", variant, f"{fwd:.2f}", f"{tf[0]:.0f}", vs[0]]
        cells += [
            f"{both:.2f}",
            f"{tf[1]:.0f}",
            vs[1],
            f"{fwd / first[0]:.3f} / {both / first[1]:.3f}",
        ]
        print("| " + " | ".join([*cells, f"{err:.1e}"]) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true", help="Triton vs dense flash (bf16)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None, help="default 5120 (CPU), 8192 (GPU)")
    parser.add_argument("--heads", type=int, default=None, help="default 8 (CPU), 16 (GPU)")
    parser.add_argument("--dim", type=int, default=None, help="default 64 (CPU), 128 (GPU)")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument(
        "--variants",
        default="default,warp_specialized",
        help="--gpu: the block-sparse kernels to time (default: the heuristic's config)",
    )
    args = parser.parse_args()
    defaults = (8192, 16, 128) if args.gpu else (5120, 8, 64)
    s, h, d = (x or y for x, y in zip((args.seq, args.heads, args.dim), defaults, strict=True))
    b, blk = args.batch, args.block
    if args.gpu:
        gpu(b, s, h, d, blk, args.variants.split(","))
        return
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
