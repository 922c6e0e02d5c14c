"""A/B on the GPU through the op, interleaved rounds (run from the repository root with ours
installed, as ``benchmarks/gpu_attention.sh`` does): the causal Gluon forward at D 128 in grid
order (``HEAD_GROUP`` 0) against longest query tiles first in head groups of 8 and 16, forward
and forward+backward, beside cuDNN, at B·S = 16384 and H 16."""

import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax
import jax.numpy as jnp

import ejkernel
from ejkernel_triton.ops import flash_attention as fa

ROUNDS = 5


def ours(group):
    def attn(q, k, v, causal):
        fa._PINGPONG_HEAD_GROUP = group  # read when the forward is traced
        return ejkernel.flash_attention(q, k, v, causal=causal, platform="triton")

    return attn


def passes(attn):
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, True))
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: attn(*a, True), q, k, v)[1](do))
    return fwd, fwd_bwd


impls = ba.implementations()
for b, s in ((8, 2048), (4, 4096), (2, 8192)):
    shape = (b, s, 16, 128)
    ks = jax.random.split(jax.random.PRNGKey(s), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks)
    fns = {f"group {g}": passes(ours(g)) for g in (0, 8, 16)}
    fns["cuDNN"] = passes(impls["cuDNN"])
    want = fns["cuDNN"][0](q, k, v).astype(jnp.float32)
    for name, (fwd, fwd_bwd) in fns.items():  # trace each now, with its order
        out = fwd(q, k, v).astype(jnp.float32)
        err = float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))
        jax.block_until_ready(fwd_bwd(q, k, v, do))
        print(f"{shape} {name}: out vs cuDNN {err:.1e}", flush=True)
    total = ba.flops(*shape, True)
    res: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for n, (fwd, fwd_bwd) in fns.items():
            res.setdefault(f"fwd {n}", []).append(
                total / ba.timed(fwd, q, k, v, iters=20, repeats=3) / 1e9
            )
            res.setdefault(f"fwd+bwd {n}", []).append(
                3.5 * total / ba.timed(fwd_bwd, q, k, v, do, iters=10, repeats=3) / 1e9
            )
    print(f"== {shape} causal TFLOP/s (median; rounds)", flush=True)
    for n, xs in res.items():
        print(f"  {n:18s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))
