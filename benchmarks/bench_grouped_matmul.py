"""Grouped matmul: ejkernel's XLA implementation against ``jax.lax.ragged_dot`` and the reference.

Forward and forward+backward (d_lhs and d_rhs) on float32 at modest CPU shapes, with a skewed
routing that leaves one expert empty and some rows unrouted. FLOPs are the useful ones,
2·M·K·N forward and 3× that forward+backward; each implementation's result is checked
against the float32 reference in the same run (relative error), so a fast wrong kernel never
counts. A plain dense matmul of the same size ([M, K] × [K, N]) is the ceiling.

GPU (``--gpu``): bf16 MoE shapes of BENCHMARKS.md, the XLA implementation (called directly, at
several tile sizes) against ``lax.ragged_dot`` and one dense matmul, TFLOP/s, with the relative
error against ``ragged_dot`` (the float32 reference is too large at these shapes).

Run: ``python benchmarks/bench_grouped_matmul.py [--gpu] [--shapes M,K,N,G ...] [--dtype bfloat16]``
``--gpu --rounds R [--grad] [--configs bm,bn,stages ...]``: the Pallas kernels at the heuristic's
config and at each config beside the dense matmul in R rotating rounds of one process (the A/B
of kernel variants a config selects).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import import_tokamax, print_rounds, rotating_rounds, timed

import ejkernel
from ejkernel.specs.grouped_matmul import grouped_matmul_reference


def skewed_sizes(m: int, g: int, seed: int = 0) -> np.ndarray:
    """Dirichlet-skewed rows per expert over 95% of M; expert 1 gets none."""
    p = np.random.default_rng(seed).dirichlet(np.ones(g))
    sizes = np.floor(p * m * 0.95).astype(np.int32)
    if g > 1:
        sizes[1] = 0
    return sizes


def problem(m: int, k: int, n: int, g: int, dtype: Any) -> tuple[jax.Array, ...]:
    """Random ``lhs [M, K]``, ``rhs [G, K, N]``, ``d_out [M, N]`` and skewed group sizes."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    lhs = jax.random.normal(keys[0], (m, k), dtype)
    rhs = jax.random.normal(keys[1], (g, k, n), dtype)
    d_out = jax.random.normal(keys[2], (m, n), dtype)
    return lhs, rhs, d_out, jnp.asarray(skewed_sizes(m, g))


def fwd_bwd(gmm: Callable[..., jax.Array]) -> Callable[..., Any]:
    def f(lhs, rhs, sizes, d_out):
        out, vjp = jax.vjp(lambda x, w: gmm(x, w, sizes), lhs, rhs)
        return out, vjp(d_out)

    return jax.jit(f)


def rel_err(x: Any, ref: Any) -> float:
    errs = [
        float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()) / jnp.linalg.norm(b.ravel()))
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(ref))
    ]
    return max(errs)


def run(shapes: list[tuple[int, int, int, int]], dtype: Any) -> None:
    impls: dict[str, Callable[..., jax.Array]] = {
        "ejkernel xla": lambda x, w, s: ejkernel.grouped_matmul(x, w, s, platform="xla"),
        "lax.ragged_dot": lambda x, w, s: jax.lax.ragged_dot(x, w, s),
        "reference (dense, all experts)": grouped_matmul_reference,
    }
    print("| M, K, N, G | impl | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s | rel err |")
    print("|---|---|---|---|---|---|---|")
    for m, k, n, g in shapes:
        lhs, rhs, d_out, sizes = problem(m, k, n, g, jnp.float32)
        expected = fwd_bwd(grouped_matmul_reference)(lhs, rhs, sizes, d_out)
        lhs, rhs, d_out = (x.astype(dtype) for x in (lhs, rhs, d_out))
        flop = 2 * m * k * n
        dense = jax.jit(lambda x, w: x @ w[0])
        t_dense = timed(dense, lhs, rhs, iters=5)
        print(
            f"| {m}, {k}, {n}, {g} | dense [M,K]x[K,N] (ceiling) | {t_dense:.2f} | {flop / t_dense / 1e6:.1f} | | | |"
        )
        for name, gmm in impls.items():
            try:
                fwd = jax.jit(gmm)
                both = fwd_bwd(gmm)
                err = rel_err(both(lhs, rhs, sizes, d_out), expected)
                t_f = timed(fwd, lhs, rhs, sizes, iters=5)
                t_fb = timed(both, lhs, rhs, sizes, d_out, iters=3)
                row = f"{t_f:.2f} | {flop / t_f / 1e6:.1f} | {t_fb:.2f} | {3 * flop / t_fb / 1e6:.1f} | {err:.1e}"
            except Exception as e:  # unsupported, out of memory: reported, never fatal
                row = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | | "
            print(f"| {m}, {k}, {n}, {g} | {name} | {row} |", flush=True)


def routing(m: int, g: int, kind: str, seed: int = 0) -> np.ndarray:
    """``even``: M / G rows each; ``zipf``: expert i gets rows ∝ 1 / (i + 1)^1.2 in a random
    order, a sixteenth of the experts none, every row routed."""
    if kind == "even":
        return np.diff(np.linspace(0, m, g + 1).astype(np.int64)).astype(np.int32)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, g + 1) ** 1.2
    rng.shuffle(weights)
    weights[rng.choice(g, size=max(1, g // 16), replace=False)] = 0.0
    sizes = np.floor(weights / weights.sum() * m).astype(np.int32)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes


def mgpu_anchor(config: dict[str, int]) -> Callable[..., jax.Array] | None:
    """JAX's own Mosaic GPU ``ragged_dot`` (forward only), or None where this jax lacks it."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except ImportError:
        return None
    return lambda x, w, s: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=s, **config)


MGPU_CONFIGS = (
    {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 5, "grid_block_n": 4},
    {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
    {"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2},
)


def pallas_config(text: str) -> Any:
    """``"bm,bn,stages"`` -> the Pallas Mosaic GPU kernels' config (block_k 64)."""
    from ejkernel_pallas.gpu.grouped_matmul import GroupedMatmulConfig

    bm, bn, stages = (int(v) for v in text.split(","))
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=64, stages=stages)


def gpu_problem(m: int, k: int, n: int, g: int, kind: str) -> tuple[jax.Array, ...]:
    """bf16 ``lhs [M, K]``, ``rhs [G, K, N]``, ``d_out [M, N]`` and ``kind``'s routing."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16)
    d_out = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    return lhs, rhs, d_out, jnp.asarray(routing(m, g, kind))


def gpu(
    shapes: list[tuple[int, int, int, int, str]], configs: list[str], anchors: bool = True
) -> None:
    """TFLOP/s (useful flops) forward and forward+backward against a dense matmul of the same
    size, ``lax.ragged_dot``, JAX's ``ragged_dot_mgpu`` and tokamax where they run; the error
    of each against the XLA platform run in float32."""
    print(
        "| M, K, N, G, routing | impl | fwd ms | fwd TFLOP/s | ÷ dense | fwd+bwd ms | "
        "fwd+bwd TFLOP/s | ÷ dense | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m, k, n, g, kind in shapes:
        lhs, rhs, d_out, sizes = gpu_problem(m, k, n, g, kind)
        label = f"{m}, {k}, {n}, {g}, {kind}"
        flop = 2 * m * k * n
        f32 = jax.tree.map(lambda x: x.astype(jnp.float32), (lhs, rhs, d_out))
        ragged = lambda x, w, s: jax.lax.ragged_dot(x, w, s)
        xla = lambda x, w, s: ejkernel.grouped_matmul(x, w, s, platform="xla")
        expected = fwd_bwd(xla)(f32[0], f32[1], sizes, f32[2])
        dense = lambda x, w, s: x @ w[0]
        t_df = timed(jax.jit(dense), lhs, rhs, sizes, iters=10, warm_s=0.3)
        t_db = timed(fwd_bwd(dense), lhs, rhs, sizes, d_out, iters=5, warm_s=0.3)
        print(
            f"| {label} | dense [M,K]x[K,N] (ceiling) | {t_df:.3f} | {flop / t_df / 1e9:.0f} | 1 "
            f"| {t_db:.3f} | {3 * flop / t_db / 1e9:.0f} | 1 | |",
            flush=True,
        )
        impls: dict[str, tuple[Callable[..., jax.Array], bool]] = {
            "ejkernel pallas": (
                lambda x, w, s: ejkernel.grouped_matmul(x, w, s, platform="pallas"),
                True,
            ),
        }
        for text in configs:
            cfg = pallas_config(text)
            impls[f"ejkernel pallas {text}"] = (
                lambda x, w, s, cfg=cfg: ejkernel.grouped_matmul(
                    x, w, s, platform="pallas", cfg=cfg
                ),
                True,
            )
        if anchors:
            impls.update({"ejkernel xla": (xla, True), "lax.ragged_dot": (ragged, True)})
        for config in MGPU_CONFIGS if anchors else ():
            anchor = mgpu_anchor(config)
            if anchor is not None:
                c = config
                label_c = (
                    f"{c['block_m']}x{c['block_n']}, {c['max_concurrent_steps']} stages, "
                    f"grid_block_n {c['grid_block_n']}"
                )
                impls[f"jax ragged_dot_mgpu {label_c}"] = (anchor, False)
        try:
            if not anchors:
                raise ImportError
            ragged_dot = import_tokamax().ragged_dot
            impls["tokamax ragged_dot"] = (
                functools.partial(ragged_dot, implementation="mosaic"),
                True,
            )
        except ImportError:
            if anchors:
                print(f"| {label} | tokamax ragged_dot | not installed | | | | | | |")
        for name, (gmm, differentiable) in impls.items():
            try:
                out = jax.jit(gmm)(lhs, rhs, sizes)
                if differentiable:
                    err = rel_err(fwd_bwd(gmm)(lhs, rhs, sizes, d_out), expected)
                else:
                    err = rel_err(out, expected[0])
                # lax.ragged_dot runs every row through every expert: G times the work.
                slow = name == "lax.ragged_dot"
                iters = {"iters": 1, "repeats": 3} if slow else {"iters": 10, "warm_s": 0.3}
                t_f = timed(jax.jit(gmm), lhs, rhs, sizes, **iters)
                row = f"{t_f:.3f} | {flop / t_f / 1e9:.0f} | {t_df / t_f:.2f}"
                if differentiable:
                    t_b = timed(fwd_bwd(gmm), lhs, rhs, sizes, d_out, **iters)
                    row += f" | {t_b:.3f} | {3 * flop / t_b / 1e9:.0f} | {t_db / t_b:.2f}"
                else:
                    row += " | no VJP | |"
                row += f" | {err:.1e}"
            except Exception as e:  # out of memory, unsupported: reported, never fatal
                row = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | | | | "
            print(f"| {label} | {name} | {row} |", flush=True)


def gpu_rounds(
    shapes: list[tuple[int, int, int, int, str]], configs: list[str], rounds: int, grad: bool
) -> None:
    """The Pallas kernels at the heuristic's config and at each of ``configs`` beside the dense
    matmul in ``rounds`` rotating rounds in one process: the A/B of kernel variants a config
    selects, with the spread between rounds shown (the ratio to dense moves by several percent
    between processes)."""
    for m, k, n, g, kind in shapes:
        lhs, rhs, d_out, sizes = gpu_problem(m, k, n, g, kind)
        gmms: dict[str, Callable[..., jax.Array]] = {
            "dense": lambda x, w, s: x @ w[0],
            "ejkernel pallas": lambda x, w, s: ejkernel.grouped_matmul(x, w, s, platform="pallas"),
        }
        for text in configs:
            cfg = pallas_config(text)
            gmms[f"ejkernel pallas {text}"] = lambda x, w, s, cfg=cfg: ejkernel.grouped_matmul(
                x, w, s, platform="pallas", cfg=cfg
            )
        if grad:
            fns = {name: fwd_bwd(f) for name, f in gmms.items()}
            args, gflop = (lhs, rhs, sizes, d_out), 3 * 2 * m * k * n / 1e9
        else:
            fns = {name: jax.jit(f) for name, f in gmms.items()}
            args, gflop = (lhs, rhs, sizes), 2 * m * k * n / 1e9
        for name, fn in fns.items():  # compiled one by one, each reported as it ends
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            print(f"  compiled and ran {name} in {time.perf_counter() - start:.1f} s", flush=True)
        res = rotating_rounds(fns, args, rounds, gflop)
        what = "fwd+bwd" if grad else "fwd"
        print_rounds(f"{m}, {k}, {n}, {g}, {kind} {what}, {rounds} rounds", res, "dense")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--shapes", nargs="*", default=None, help="M,K,N,G")
    parser.add_argument("--dtype", default="float32", help="cpu")
    parser.add_argument("--routing", default="even", choices=("even", "zipf"), help="gpu")
    parser.add_argument(
        "--configs", nargs="*", default=[], help="gpu: Pallas configs bm,bn,stages to time too"
    )
    parser.add_argument("--no-anchors", action="store_true", help="gpu: ejkernel pallas only")
    parser.add_argument(
        "--rounds", type=int, default=0, help="gpu: the Pallas configs beside dense, rotating"
    )
    parser.add_argument("--grad", action="store_true", help="gpu --rounds: forward+backward")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else None
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    print("skewed routing (one empty expert, 5% of rows unrouted)")
    if args.gpu:
        default = [(16384, 4096, 4096, 8, "even"), (32768, 2048, 1408, 64, "zipf")]
        gpu_shapes = [(*s[:4], args.routing) for s in shapes] if shapes else default
        if args.rounds:
            gpu_rounds(gpu_shapes, args.configs, args.rounds, args.grad)  # type: ignore[arg-type]
        else:
            gpu(gpu_shapes, args.configs, anchors=not args.no_anchors)  # type: ignore[arg-type]
    else:
        default = [(1024, 512, 512, 8), (1024, 512, 512, 32)]
        with ejkernel.ops.policy_override(autotune=False):  # the heuristic's tile, as shipped
            run(shapes or default, jnp.dtype(args.dtype))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
