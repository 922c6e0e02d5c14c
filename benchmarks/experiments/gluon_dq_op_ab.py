"""A/B on the GPU through the op, fwd+bwd, interleaved rounds (run from the repository root
with ours installed, as ``benchmarks/gpu_attention.sh`` does): under the heuristic's
warp-specialized config at D 128, the backward's dQ by the Gluon kernel against the
warp-specialized Triton one (both after the Gluon dK/dV kernel), beside cuDNN."""

import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax
import jax.numpy as jnp

import ejkernel
from ejkernel_triton.ops import flash_attention as fa

ROUNDS = 5
gluon_dq = fa._dq_gluon


def fwd_bwd(attn, causal):
    def loss(q, k, v, do):
        return jnp.sum(attn(q, k, v, causal).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def ours(dq):
    def attn(q, k, v, causal):
        fa._dq_gluon = dq  # read when the backward is traced
        return ejkernel.flash_attention(q, k, v, causal=causal, platform="triton")

    return attn


impls = ba.implementations()
for causal in (True, False):
    shape = (4, 4096, 16, 128)
    ks = jax.random.split(jax.random.PRNGKey(causal), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks)
    fns = {
        "gluon dQ": fwd_bwd(ours(gluon_dq), causal),
        "ws dQ": fwd_bwd(ours(fa._dq_ws), causal),
        "cuDNN": fwd_bwd(impls["cuDNN"], causal),
    }
    for f in fns.values():  # trace each now, with its dQ kernel
        jax.block_until_ready(f(q, k, v, do))
    total = 3.5 * ba.flops(*shape, causal)
    res = {}
    for _ in range(ROUNDS):
        for n, f in fns.items():
            res.setdefault(n, []).append(
                total / ba.timed(f, q, k, v, do, iters=10, repeats=3) / 1e9
            )
    print(f"== fwd+bwd {shape} causal={causal} TFLOP/s (median; rounds)", flush=True)
    for n, xs in res.items():
        print(f"  {n:10s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))
