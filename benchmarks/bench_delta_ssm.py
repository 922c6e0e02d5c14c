"""Gated delta rule and state-space ops on XLA: chunked implementations against sequential scans.

Times, on this machine's CPU, ``ejkernel.kernel_delta_attention`` (per-channel decays, Kimi
Delta Attention, and per-head decays, Gated DeltaNet), ``ejkernel.state_space_v1`` (Mamba-1)
and ``ejkernel.state_space_v2`` (Mamba-2 SSD), each through the executor with its heuristic
config, against the spec's reference: a ``lax.scan`` over time. Forward, and forward+backward
(``jax.vjp`` with a ones cotangent). Each run also reports the relative error against the
reference, so a fast wrong kernel never counts. Then the compiled temporary memory
(``memory_analysis().temp_size_in_bytes``) of the forward+backward for several T: linear in T
for the chunked implementations; the reference's autodiff stores a state per token.

Timing: contenders run interleaved and the best of ``--repeats`` runs is kept, as wall time
and as process CPU time (all threads), so other processes on a shared machine disturb the
ratios as little as possible.

Run: ``python benchmarks/bench_delta_ssm.py [--seq 4096] [--repeats 5] [--skip-bwd]``
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ejkernel
from ejkernel.specs.kernel_delta_attention import kernel_delta_attention_reference
from ejkernel.specs.state_space_v1 import state_space_v1_reference
from ejkernel.specs.state_space_v2 import state_space_v2_reference


def kda_inputs(b: int, t: int, h: int, dk: int, dv: int, per_channel: bool) -> dict[str, jax.Array]:
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    g_shape = (b, t, h, dk) if per_channel else (b, t, h)
    return {
        "query": jax.random.normal(ks[0], (b, t, h, dk)),
        "key": jax.random.normal(ks[1], (b, t, h, dk)),
        "value": jax.random.normal(ks[2], (b, t, h, dv)),
        "beta": jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h))),
        "g": -0.1 * jax.nn.softplus(jax.random.normal(ks[4], g_shape)),
    }


def ssm_inputs(version: int, b: int, t: int, *dims: int) -> dict[str, jax.Array]:
    ks = jax.random.split(jax.random.PRNGKey(1), 6)
    if version == 1:
        i, n = dims
        shapes = {
            "x": (b, t, i),
            "A": (i, n),
            "B": (b, t, n),
            "C": (b, t, n),
            "D": (i,),
            "dt": (b, t, i),
        }
    else:
        h, p, g, n = dims
        shapes = {
            "x": (b, t, h, p),
            "A": (h,),
            "B": (b, t, g, n),
            "C": (b, t, g, n),
            "D": (h,),
            "dt": (b, t, h),
        }
    arrays = {name: jax.random.normal(k, shape) for k, (name, shape) in zip(ks, shapes.items())}
    arrays["A"] = -jnp.exp(0.5 * arrays["A"])
    return arrays


def forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    return jax.jit(lambda arrays: fn(**arrays))


def forward_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    def f(arrays: dict[str, Any]) -> Any:
        out, vjp = jax.vjp(lambda a: fn(**a), arrays)
        return out, vjp(jnp.ones_like(out))

    return jax.jit(f)


def best_times(
    contenders: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, tuple[float, float]]:
    """Best wall time and best process CPU time (ms) of each contender, runs interleaved."""
    for run in contenders.values():
        jax.block_until_ready(run())
    wall = dict.fromkeys(contenders, float("inf"))
    cpu = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, run in contenders.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(run())
            wall[name] = min(wall[name], (time.perf_counter() - t0) * 1e3)
            cpu[name] = min(cpu[name], (time.process_time() - c0) * 1e3)
    return {name: (wall[name], cpu[name]) for name in contenders}


def relative_error(ours: Any, ref: Any) -> float:
    errors = [
        float(
            jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
            / (jnp.max(jnp.abs(b)) + 1e-30)
        )
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True)
    ]
    return max(errors)


def compare(
    title: str,
    ours: Callable[..., Any],
    ref: Callable[..., Any],
    arrays: dict[str, Any],
    args: Any,
    scan_bwd: bool = True,
) -> None:
    """One table row per pass; ``scan_bwd=False`` times the sequential scan's forward only
    (its backward would keep a state per token)."""
    modes = [("forward", forward)] + (
        [] if args.skip_bwd else [("forward+backward", forward_backward)]
    )
    for mode, wrap in modes:
        f_ours = wrap(ours)
        if mode == "forward" or scan_bwd:
            f_ref = wrap(ref)
            err = f"{relative_error(f_ours(arrays), f_ref(arrays)):.1e}"
            runs = {"chunked": lambda f=f_ours: f(arrays), "sequential": lambda f=f_ref: f(arrays)}
        else:
            err, runs = "n/a", {"chunked": lambda f=f_ours: f(arrays)}
        times = best_times(runs, args.repeats)
        (w_c, c_c) = times["chunked"]
        if "sequential" in times:
            (w_s, c_s) = times["sequential"]
            seq, ratio = f"{w_s:8.1f} / {c_s:8.1f}", f"{w_s / w_c:5.2f}x / {c_s / c_c:5.2f}x"
        else:
            seq, ratio = "n/a (states too large)", "n/a"
        print(
            f"| {title} | {mode} | {w_c:8.1f} / {c_c:8.1f} | {seq} | {ratio} | {err} |",
            flush=True,
        )


def temp_bytes(fn: Callable[..., Any], arrays: dict[str, Any]) -> int | None:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    memory = forward_backward(fn).lower(abstract).compile().memory_analysis()
    return None if memory is None else int(memory.temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="T of the timing runs")
    parser.add_argument(
        "--kda",
        nargs="*",
        default=["1,4,128,128", "8,16,128,128"],
        help="B,H,K,V of kernel_delta_attention (the second: B·T = 32k at T 4096, H 16)",
    )
    parser.add_argument(
        "--max-scan-gib",
        type=float,
        default=4.0,
        help="time the reference scan's forward+backward only when its states fit in this",
    )
    parser.add_argument("--v1", default="1,512,16", help="B,I,N of state_space_v1")
    parser.add_argument("--v2", default="1,8,64,1,64", help="B,H,P,G,N of state_space_v2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-bwd", action="store_true", help="time the forward only")
    parser.add_argument(
        "--kda-only", action="store_true", help="kernel_delta_attention rows and memory only"
    )
    parser.add_argument("--memory-seqs", default="1024,2048,4096,8192")
    args = parser.parse_args()
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    t = args.seq
    kda_shapes = [tuple(map(int, shape.split(","))) for shape in args.kda]
    b, h, dk, dv = kda_shapes[0]
    v1 = tuple(map(int, args.v1.split(",")))
    v2 = tuple(map(int, args.v2.split(",")))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, T={t}")
    print(f"load average at start: {os.getloadavg()}")
    print(
        "times in ms as wall / process CPU (best of runs; the CPU time misses work on XLA's"
        " matmul threads, so quote the wall time); ratio = sequential / chunked"
    )
    print("| op | pass | chunked | sequential (reference scan) | speed-up | rel. error |")
    print("|---|---|---|---|---|---|")
    for kb, kh, kk, kv in kda_shapes:
        scan_gib = kb * t * kh * kk * kv * 4 / 2**30
        for per_channel, label in (
            (True, "KDA, g [B,S,H,K]"),
            (False, "Gated DeltaNet, g [B,S,H]"),
        ):
            arrays = kda_inputs(kb, t, kh, kk, kv, per_channel)
            config = ejkernel.explain("kernel_delta_attention", **arrays).config
            title = (
                f"kernel_delta_attention {label} B{kb} H{kh} K{kk} V{kv} (C={config.chunk_size})"
            )
            compare(
                title,
                ejkernel.kernel_delta_attention,
                kernel_delta_attention_reference,
                arrays,
                args,
                scan_bwd=scan_gib <= args.max_scan_gib,
            )
    softplus = lambda fn: lambda **kw: fn(**kw, dt_softplus=True)
    if not args.kda_only:
        arrays = ssm_inputs(1, v1[0], t, *v1[1:])
        config = ejkernel.explain("state_space_v1", **arrays, dt_softplus=True).config
        title = f"state_space_v1 B{v1[0]} I{v1[1]} N{v1[2]} (C={config.chunk_size}, {config.intra_chunk})"
        compare(
            title,
            softplus(ejkernel.state_space_v1),
            softplus(state_space_v1_reference),
            arrays,
            args,
        )
        arrays = ssm_inputs(2, v2[0], t, *v2[1:])
        config = ejkernel.explain("state_space_v2", **arrays, dt_softplus=True).config
        title = (
            f"state_space_v2 B{v2[0]} H{v2[1]} P{v2[2]} G{v2[3]} N{v2[4]} (C={config.chunk_size})"
        )
        compare(
            title,
            softplus(ejkernel.state_space_v2),
            softplus(state_space_v2_reference),
            arrays,
            args,
        )

    print("\nCompiled temporary memory of forward+backward (MiB), by T:")
    seqs = [int(s) for s in args.memory_seqs.split(",")]
    print("| op | " + " | ".join(f"T={s}" for s in seqs) + " |")
    print("|---|" + "---|" * len(seqs))
    ops = [
        (
            "kernel_delta_attention (KDA)",
            ejkernel.kernel_delta_attention,
            kernel_delta_attention_reference,
            lambda s: kda_inputs(b, s, h, dk, dv, True),
        ),
        (
            "state_space_v1",
            softplus(ejkernel.state_space_v1),
            softplus(state_space_v1_reference),
            lambda s: ssm_inputs(1, v1[0], s, *v1[1:]),
        ),
        (
            "state_space_v2",
            softplus(ejkernel.state_space_v2),
            softplus(state_space_v2_reference),
            lambda s: ssm_inputs(2, v2[0], s, *v2[1:]),
        ),
    ]
    if args.kda_only:
        ops = ops[:1]
    rows = [
        (f"{op} {kind}", fn, make)
        for op, chunked, scan, make in ops
        for kind, fn in (("chunked", chunked), ("reference scan", scan))
    ]
    for name, fn, make in rows:
        sizes = [temp_bytes(fn, make(s)) for s in seqs]
        cells = ["n/a" if v is None else f"{v / 2**20:9.1f}" for v in sizes]
        growth = ""
        if None not in sizes and sizes[0]:
            growth = f" (x{np.round(sizes[-1] / sizes[0], 1)} for x{seqs[-1] // seqs[0]} T)"
        print(f"| {name}{growth} | " + " | ".join(cells) + " |", flush=True)

    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
