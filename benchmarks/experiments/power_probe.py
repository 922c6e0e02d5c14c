"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): the SM clock and power while a D 128 forward+backward
runs for ``RUN_S`` seconds (sampled by ``nvidia-smi`` every 100 ms), with the time a call,
for ours (the backward variants of ``bwd_profile.py``) and cuDNN, causal and not. Whether the
GPU sits at its power limit decides whether a better schedule of the same work can pay."""

import statistics
import subprocess
import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import bench_attention as ba
import bwd_profile as bp
import jax
import jax.numpy as jnp

RUN_S = 2.0
QUERY = "clocks.sm,power.draw,power.limit,temperature.gpu"


def sampled(f, *args):
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < RUN_S:
        jax.block_until_ready([f(*args) for _ in range(10)])
        calls += 10
    ms = (time.perf_counter() - t0) / calls * 1e3
    smi.terminate()
    rows = [[float(x) for x in line.split(",")] for line in smi.stdout.read().splitlines()[3:]]
    cols = list(zip(*rows)) if rows else [[0.0]] * 4
    return ms, [statistics.median(c) for c in cols]


for causal in (True, False):
    shape = (4, 4096, 16, 128)
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks)

    fns = {n: bp.traced(ba.ours_vjp(causal), var, q, k, v, do) for n, var in bp.VARIANTS.items()}
    for name in ("cuDNN", "tokamax triton"):
        impl = ba.implementations().get(name)
        if impl:
            fns[name] = jax.jit(
                lambda q, k, v, do, a=impl: jax.vjp(lambda *x: a(*x, causal), q, k, v)[1](do)  # noqa: B023
            )
    total = 3.5 * ba.flops(*shape, causal)
    for _ in range(2):
        for name, f in fns.items():
            ms, (clock, power, limit, temp) = sampled(f, q, k, v, do)
            print(
                f"{shape} causal={causal} {name:20s} {ms:.3f} ms ({total / ms / 1e9:.0f} TFLOP/s)"
                f"  SM {clock:.0f} MHz, {power:.0f} W of {limit:.0f}, {temp:.0f} C",
                flush=True,
            )
