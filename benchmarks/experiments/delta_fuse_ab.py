"""A/B on the GPU, one process, rotating rounds at the steady clock (run from the repository
root with ours installed, as ``benchmarks/gpu_attention.sh`` does): delta (``rowsum(out ∘ dO)``)
computed by the Gluon dQ kernel, which then runs first (``_DQ_FUSED_DELTA``), against a
separate XLA reduction before the dK/dV and dQ kernels; fwd+bwd through the op at D 128,
beside cuDNN and tokamax's Triton attention; gradients of the two compared.

The variant lives in commit b5f4964 only: neutral on an H200 (393 / 395 TFLOP/s causal, 464 /
469 non-causal at S 4096; 449 / 449 causal at S 8192), it was taken out again in the next
commit. Check that commit out to run this."""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax
import jax.numpy as jnp

from ejkernel_triton.ops import flash_attention as fa

ROUNDS = 5


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


for shape, causal in [
    ((4, 4096, 16, 128), True),
    ((4, 4096, 16, 128), False),
    ((2, 8192, 16, 128), True),
]:
    q, k, v, do = ba.normal_inputs(shape, 7)
    ours = ba.ours_vjp(causal)

    fns = {}
    for fused in (True, False):
        fa._DQ_FUSED_DELTA = fused  # read when the backward is traced
        fns[f"fused delta {fused}"] = jax.jit(lambda *a: ours(*a))
        jax.block_until_ready(fns[f"fused delta {fused}"](q, k, v, do))
    fa._DQ_FUSED_DELTA = True
    impls = ba.implementations()
    for name in ("cuDNN", "tokamax triton"):
        if name in impls:
            attn = impls[name]
            fns[name] = jax.jit(
                lambda q, k, v, do, attn=attn: jax.vjp(lambda *a: attn(*a, causal), q, k, v)[1](do)
            )
    a, b, c = (
        fns["fused delta True"](q, k, v, do),
        fns["fused delta False"](q, k, v, do),
        fns["cuDNN"](q, k, v, do),
    )
    print(
        f"{shape} causal={causal}: fused vs not dq dk dv "
        + " ".join(f"{rel(x, y):.1e}" for x, y in zip(a, b))
        + "; fused vs cuDNN "
        + " ".join(f"{rel(x, y):.1e}" for x, y in zip(a, c)),
        flush=True,
    )
    total = 3.5 * ba.flops(*shape, causal)
    names, res = list(fns), {}
    for r in range(ROUNDS):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            res.setdefault(n, []).append(total / ba.timed(fns[n], q, k, v, do, iters=20) / 1e9)
    print(f"== {shape} causal={causal} fwd+bwd TFLOP/s (median of {ROUNDS}; rounds)", flush=True)
    for n, xs in res.items():
        print(f"  {n:20s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))
