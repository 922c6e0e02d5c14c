"""One process's view of the causal D 128 spread (run from the repository root with ours
installed, as ``benchmarks/gpu_attention.sh`` does; ``causal_spread.sh`` runs it in N fresh
processes): ours fwd and fwd+bwd, cuDNN's and, with the anchors installed, tokamax Triton's,
interleaved rounds at (4, 4096, 16, 128) causal, each round's TFLOP/s printed."""

import os
import statistics
import sys

os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")  # as the harness: no tuning
sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax
import jax.numpy as jnp

ROUNDS = 5
SHAPE = (4, 4096, 16, 128)

impls = {
    n: f
    for n, f in ba.implementations().items()
    if n in ("ejkernel triton", "cuDNN", "tokamax triton")
}
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, do = (jax.random.normal(x, SHAPE, jnp.float32).astype(jnp.bfloat16) for x in ks)
fns = {}
for name, attn in impls.items():
    fns[f"fwd {name}"] = (jax.jit(lambda q, k, v, attn=attn: attn(q, k, v, True)), (q, k, v), 1.0)
    fns[f"fwd+bwd {name}"] = (
        jax.jit(lambda q, k, v, do, attn=attn: jax.vjp(lambda *a: attn(*a, True), q, k, v)[1](do)),
        (q, k, v, do),
        3.5,
    )
total = ba.flops(*SHAPE, True)
res: dict[str, list[float]] = {}
for _ in range(ROUNDS):
    for n, (f, args, mult) in fns.items():
        res.setdefault(n, []).append(mult * total / ba.timed(f, *args, iters=10, repeats=3) / 1e9)
for n, xs in res.items():
    print(
        f"  {n:24s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs), flush=True
    )
