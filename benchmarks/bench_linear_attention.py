"""Linear attention on XLA: chunked gla / lightning_attention against a sequential scan.

Times, on the CPU, the chunked XLA implementations (``ejkernel.gla``,
``ejkernel.lightning_attention`` through the executor) against two sequential ``lax.scan``
recurrences: the spec's reference (the oracle, which also tracks packed sequences and final
states) and a lean scan that does only the recurrence. Forward, and forward+backward. Then the
compiled temporary memory (``memory_analysis().temp_size_in_bytes``) of gla's forward alone
and of its forward+backward for T = 1k … 8k, which grows linearly in T, beside the lean
scan's forward+backward (whose backward keeps every step's [B, H, K, V] state).

Default shapes: two small ones (B 1, H 4-8, where a scan's state fits in cache) and the
realistic one of ``shared/BENCHMARKS.md`` (B·T = 32k: B 8, T 4096, H 16, K = V = 128). There
the scans' backward would keep T·B·H·K·V floats (32 GiB), so forward+backward is timed for the
chunked form only (``--max-scan-gib``).

Cost per token and head (forward; C the chunk): the scan does ~5·K·V flops (decay, k vᵀ,
q·h) and moves the [K, V] state through memory every step (8·K·V bytes once B·H·K·V floats
no longer fit in cache); the chunked form does 4·K·V + 2·C·(K + V) flops (q·S, kᵀv, the [C, C]
scores and their product with v) as batched matmuls, and moves 4·K·V / C bytes of state.

Timing: each contender runs interleaved with the others, the best wall time of ``--repeats``
runs is kept (compilation and a warm-up run first, ``jax.block_until_ready``). The load average
is printed before and after: the machine is shared. Configs come from the heuristics
(``EJKERNEL_AUTOTUNE_POLICY=heuristics`` unless set).

Run: ``python benchmarks/bench_linear_attention.py [--shape B,T,H,K,V ...] [--repeats N]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ejkernel
from ejkernel.specs.gla import gla_reference
from ejkernel.specs.lightning_attention import lightning_attention_reference


def lean_scan(q: Any, k: Any, v: Any, log_decay: Any) -> jax.Array:
    """The plain recurrence ``h = h ⊙ exp(g)[:, None] + kᵀ v``, ``o = scale · q h`` over time."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5

    def step(state: Any, x: Any) -> tuple[Any, Any]:
        q_t, k_t, v_t, g_t = x
        state = state * jnp.exp(g_t)[..., None] + k_t[..., :, None] * v_t[..., None, :]
        return state, jnp.einsum("bhk,bhkv->bhv", q_t * scale, state)

    g = jnp.broadcast_to(log_decay, q.shape)
    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g))
    _, out = jax.lax.scan(step, jnp.zeros((b, h, dk, dv), jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1).astype(q.dtype)


def fwd_bwd(fn: Callable[..., Any]) -> Callable[..., Any]:
    def f(*args: Any) -> Any:
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jnp.ones_like(out))

    return jax.jit(f)


def best_times(
    contenders: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]], repeats: int
) -> dict[str, float]:
    """Best wall time (ms) of each contender, runs interleaved (after a warm-up run)."""
    for fn, args in contenders.values():
        jax.block_until_ready(fn(*args))
    wall = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, (fn, args) in contenders.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall[name] = min(wall[name], (time.perf_counter() - t0) * 1e3)
    return wall


def flops_per_token(dk: int, dv: int, chunk: int) -> tuple[int, int]:
    """Forward flops per token and head: (chunked, scan); see the module docstring."""
    return 4 * dk * dv + 2 * chunk * (dk + dv), 5 * dk * dv


def matmul_ceiling() -> tuple[float, float]:
    """GFLOP/s of one large float32 matmul (2048³) and of a batched one shaped like a chunk's
    work ([1024, 64, 128] × [1024, 128, 128]) on this machine."""
    key = jax.random.PRNGKey(0)
    out = []
    for lhs, rhs in (((2048, 2048), (2048, 2048)), ((1024, 64, 128), (1024, 128, 128))):
        x, y = jax.random.normal(key, lhs), jax.random.normal(key, rhs)
        f = jax.jit(jnp.matmul)
        ms = best_times({"mm": (f, (x, y))}, 5)["mm"]
        flops = 2 * np.prod(lhs) * rhs[-1]
        out.append(flops / ms / 1e6)
    return out[0], out[1]


def inputs(b: int, t: int, h: int, dk: int, dv: int) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, dk), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, h, dk), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, h, dv), jnp.float32)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (b, t, h, dk), jnp.float32)) / 16  # GLA's gate
    return q, k, v, g


def speed(shape: tuple[int, int, int, int, int], repeats: int, max_scan_gib: float) -> None:
    b, t, h, dk, dv = shape
    q, k, v, g = inputs(*shape)
    slopes = jnp.asarray(ejkernel.specs.lightning_attention.lightning_slopes(h, 0, 24))
    gla = lambda q, k, v, g: ejkernel.gla(q, k, v, g, platform="xla")
    gla_ref = lambda q, k, v, g: gla_reference(q, k, v, g)
    la = lambda q, k, v: ejkernel.lightning_attention(q, k, v, slopes=slopes, platform="xla")
    la_ref = lambda q, k, v: lightning_attention_reference(q, k, v, slopes=slopes)
    la_lean = lambda q, k, v: lean_scan(q, k, v, -slopes[:, None])
    chunk = ejkernel.explain("gla", q, k, v, g).config.chunk_size
    ours_f, scan_f = flops_per_token(dk, dv, chunk)
    scan_states_gib = b * t * h * dk * dv * 4 / 2**30
    print(
        f"\nB={b} T={t} H={h} K={dk} V={dv} float32, chunk {chunk}: forward flops per token"
        f" and head {ours_f} (chunked) vs {scan_f} (scan); scan state {b * h * dk * dv * 4 / 2**20:.1f}"
        f" MiB, its backward would keep {scan_states_gib:.1f} GiB"
    )
    print(
        "| B, T, H, K, V | op | pass | chunked | lean scan | reference scan | vs lean | vs reference | GFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for op, (ours, ref, lean, args) in {
        "gla": (gla, gla_ref, lean_scan, (q, k, v, g)),
        "lightning_attention": (la, la_ref, la_lean, (q, k, v)),
    }.items():
        for kind, wrap in (("fwd", jax.jit), ("fwd+bwd", fwd_bwd)):
            contenders = {"ours": (wrap(ours), args)}
            if kind == "fwd" or scan_states_gib <= max_scan_gib:
                contenders |= {"lean": (wrap(lean), args), "ref": (wrap(ref), args)}
            ms = best_times(contenders, repeats)
            cells = [f"{ms[n]:.1f}" if n in ms else "n/a" for n in ("ours", "lean", "ref")]
            ratios = [f"{ms[n] / ms['ours']:.1f}x" if n in ms else "n/a" for n in ("lean", "ref")]
            gflops = ours_f * b * t * h / ms["ours"] / 1e6
            rate = f"{gflops:.0f}" if kind == "fwd" else ""
            print(
                f"| {b}, {t}, {h}, {dk}, {dv} | {op} | {kind} | {' | '.join(cells)} | "
                f"{' | '.join(ratios)} | {rate} |",
                flush=True,
            )


def memory(seqs: list[int], shape: tuple[int, int, int, int, int]) -> None:
    b, _, h, dk, dv = shape
    print(f"\ngla compiled temp memory (MiB), B={b} H={h} K={dk} V={dv} float32")
    print("| T | chunked fwd | chunked fwd+bwd | bytes / T | lean scan fwd+bwd | bytes / T |")
    print("|---|---|---|---|---|---|")
    gla = lambda q, k, v, g: ejkernel.gla(q, k, v, g, platform="xla")

    def temp(fn: Callable[..., Any], args: list[Any]) -> int | None:
        stats = fn.lower(*args).compile().memory_analysis()
        return None if stats is None else int(stats.temp_size_in_bytes)

    for t in seqs:
        args = [jax.ShapeDtypeStruct((b, t, h, n), jnp.float32) for n in (dk, dk, dv, dk)]
        sizes = [temp(jax.jit(gla), args), temp(fwd_bwd(gla), args), temp(fwd_bwd(lean_scan), args)]
        mib = lambda x: "?" if x is None else f"{x / 2**20:.1f}"
        per_t = lambda x, t=t: "?" if x is None else f"{x / t:.0f}"
        row = [
            str(t),
            mib(sizes[0]),
            mib(sizes[1]),
            per_t(sizes[1]),
            mib(sizes[2]),
            per_t(sizes[2]),
        ]
        print(f"| {' | '.join(row)} |", flush=True)


def main() -> None:
    # Heuristic configs (no autotuning) unless the caller asks otherwise: reproducible runs.
    # A private cache folder: nothing persisted by earlier runs is read, nothing is left behind.
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    os.environ.setdefault("EJKERNEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejkernel-bench-"))
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shape",
        nargs="*",
        default=["1,4096,4,64,64", "1,4096,8,128,128", "8,4096,16,128,128"],
        help="B,T,H,K,V",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-scan-gib",
        type=float,
        default=4.0,
        help="time the scans' forward+backward only when their saved states fit in this",
    )
    parser.add_argument("--memory-seqs", nargs="*", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    print(f"load average at start: {os.getloadavg()}, {os.cpu_count()} CPUs")
    big, batched = matmul_ceiling()
    print(
        f"matmul ceiling: 2048^3 {big:.0f} GFLOP/s; batched [1024,64,128]x[1024,128,128] {batched:.0f}"
    )
    print("\nbest wall ms; speed-up = scan / chunked; GFLOP/s = chunked forward flops / time")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape]
    if not args.skip_speed:
        for shape in shapes:
            speed(shape, args.repeats, args.max_scan_gib)  # type: ignore[arg-type]
    memory(args.memory_seqs, shapes[0])  # type: ignore[arg-type]
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
