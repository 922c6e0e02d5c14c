"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): whether a causal D 128 forward+backward is bound by
the host. For ours (two backward variants, as ``bwd_profile.py``) and cuDNN: after ``WARM_S``
seconds of calls, the host time to enqueue ``N`` calls, the wall time until they finish, and
the harness's timing of the same function."""

import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import bench_attention as ba
import bwd_profile as bp
import jax
import jax.numpy as jnp

WARM_S, N = 0.5, 200

for shape in [(4, 4096, 16, 128), (8, 2048, 16, 128)]:
    ks = jax.random.split(jax.random.PRNGKey(shape[1]), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks)
    fns = {
        n: bp.traced(ba.ours_vjp(causal=True), var, q, k, v, do) for n, var in bp.VARIANTS.items()
    }
    attn = ba.implementations()["cuDNN"]
    fns["cuDNN"] = jax.jit(
        lambda q, k, v, do, attn=attn: jax.vjp(lambda *a: attn(*a, True), q, k, v)[1](do)
    )
    for _ in range(2):
        for name, f in fns.items():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < WARM_S:
                jax.block_until_ready([f(q, k, v, do) for _ in range(5)])
            t0 = time.perf_counter()
            outs = [f(q, k, v, do) for _ in range(N)]
            t1 = time.perf_counter()
            jax.block_until_ready(outs)
            t2 = time.perf_counter()
            del outs
            harness = ba.timed(f, q, k, v, do, iters=20, repeats=5)
            print(
                f"{shape} {name:20s} enqueue {(t1 - t0) / N * 1e3:.3f} ms a call, "
                f"wall {(t2 - t0) / N * 1e3:.3f}, harness {harness:.3f}",
                flush=True,
            )
