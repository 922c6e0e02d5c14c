"""Linear attention on XLA: chunked gla / lightning_attention against a sequential scan.

Times, on the CPU, the chunked XLA implementations (``ejkernel.gla``,
``ejkernel.lightning_attention`` through the executor) against two sequential ``lax.scan``
recurrences: the spec's reference (the oracle, which also tracks packed sequences and final
states) and a lean scan that does only the recurrence. Forward, and forward+backward. Then the
compiled temporary memory (``memory_analysis().temp_size_in_bytes``) of gla's forward+backward
for several T, which grows linearly in T, beside the lean scan's (whose backward keeps every
step's [B, H, K, V] state).

Why the forward alone gains little on a CPU: per token and head the chunked form does about
``2·K·V + C·(K + V)`` multiply-adds (the carried state read by q, the chunk's own state, the
[C, C] intra-chunk matmuls) against the scan's ``~2.5·K·V``; its gain is matmul efficiency
and the backward, which the scan can only do by storing and revisiting every step's state.

Timing: each contender runs interleaved with the others and the best of ``--repeats`` runs is
kept, as wall time and as process CPU time (all threads), so other processes on a shared
machine disturb the ratio as little as possible. Configs come from the heuristics
(``EJKERNEL_AUTOTUNE_POLICY=heuristics`` unless set).

Run: ``python benchmarks/bench_linear_attention.py [--shape B,T,H,K,V] [--memory-seqs ...]``
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
) -> dict[str, tuple[float, float]]:
    """Best wall time and best process CPU time (ms) of each contender, runs interleaved."""
    for fn, args in contenders.values():
        jax.block_until_ready(fn(*args))
    wall = dict.fromkeys(contenders, float("inf"))
    cpu = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, (fn, args) in contenders.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            wall[name] = min(wall[name], (time.perf_counter() - t0) * 1e3)
            cpu[name] = min(cpu[name], (time.process_time() - c0) * 1e3)
    return {name: (wall[name], cpu[name]) for name in contenders}


def inputs(b: int, t: int, h: int, dk: int, dv: int) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, dk), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, h, dk), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, h, dv), jnp.float32)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (b, t, h, dk), jnp.float32)) / 16  # GLA's gate
    return q, k, v, g


def speed(shape: tuple[int, int, int, int, int], repeats: int) -> None:
    b, t, h, dk, dv = shape
    q, k, v, g = inputs(*shape)
    slopes = jnp.asarray(ejkernel.specs.lightning_attention.lightning_slopes(h, 0, 24))
    gla = lambda q, k, v, g: ejkernel.gla(q, k, v, g, platform="xla")
    gla_ref = lambda q, k, v, g: gla_reference(q, k, v, g)
    gla_lean = lean_scan
    la = lambda q, k, v: ejkernel.lightning_attention(q, k, v, slopes=slopes, platform="xla")
    la_ref = lambda q, k, v: lightning_attention_reference(q, k, v, slopes=slopes)
    la_lean = lambda q, k, v: lean_scan(q, k, v, -slopes[:, None])
    cfg = ejkernel.explain("gla", q, k, v, g).config
    print(f"shape B={b} T={t} H={h} K={dk} V={dv} float32; gla config {cfg}")
    print(
        "| op | pass | chunked ms (cpu ms) | lean scan ms (cpu ms) | reference ms (cpu ms) | speed-up vs lean, wall (cpu) | vs reference, wall (cpu) |"
    )
    print("|---|---|---|---|---|---|---|")
    for op, (ours, ref, lean, args) in {
        "gla": (gla, gla_ref, gla_lean, (q, k, v, g)),
        "lightning_attention": (la, la_ref, la_lean, (q, k, v)),
    }.items():
        for kind, wrap in (("fwd", jax.jit), ("fwd+bwd", fwd_bwd)):
            t = best_times(
                {"ours": (wrap(ours), args), "lean": (wrap(lean), args), "ref": (wrap(ref), args)},
                repeats,
            )
            cells = [f"{t[n][0]:.1f} ({t[n][1]:.1f})" for n in ("ours", "lean", "ref")]
            ratios = [
                f"{t[n][0] / t['ours'][0]:.1f}x ({t[n][1] / t['ours'][1]:.1f}x)"
                for n in ("lean", "ref")
            ]
            print(f"| {op} | {kind} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)


def memory(seqs: list[int], shape: tuple[int, int, int, int, int]) -> None:
    b, _, h, dk, dv = shape
    print(f"\ngla forward+backward compiled temp memory, B={b} H={h} K={dk} V={dv} float32")
    print("| T | chunked temp MiB | chunked bytes / T | lean scan temp MiB | lean scan bytes / T |")
    print("|---|---|---|---|---|")
    for t in seqs:
        args = [jax.ShapeDtypeStruct((b, t, h, n), jnp.float32) for n in (dk, dk, dv, dk)]
        row = [str(t)]
        for fn in (lambda q, k, v, g: ejkernel.gla(q, k, v, g, platform="xla"), lean_scan):
            stats = fwd_bwd(fn).lower(*args).compile().memory_analysis()
            temp = None if stats is None else int(stats.temp_size_in_bytes)
            row += ["?", "?"] if temp is None else [f"{temp / 2**20:.1f}", f"{temp / t:.0f}"]
        print(f"| {' | '.join(row)} |", flush=True)


def main() -> None:
    # Heuristic configs (no autotuning) unless the caller asks otherwise: reproducible runs.
    # A private cache folder: nothing persisted by earlier runs is read, nothing is left behind.
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    os.environ.setdefault("EJKERNEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejkernel-bench-"))
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shape", nargs="*", default=["1,4096,4,64,64", "1,4096,8,128,128"], help="B,T,H,K,V"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--memory-seqs", nargs="*", type=int, default=[1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape]
    if not args.skip_speed:
        for shape in shapes:
            speed(shape, args.repeats)  # type: ignore[arg-type]
    memory(args.memory_seqs, shapes[0])  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
