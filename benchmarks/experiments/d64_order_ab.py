"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): D 64 causal forward+backward, (8, 2048, 16, 64), with
the Gluon backward kernel's causal order (``_BWD_HEAD_GROUP``) 0 and 8, beside cuDNN; each
timed after a warm-up of 0.3 s (steady clock) and of none (burst), in rotating rounds."""

import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax

from ejkernel_triton.ops import flash_attention as fa

ROUNDS = 3
shape = (8, 2048, 16, 64)
q, k, v, do = ba.normal_inputs(shape, 3)
ours = ba.ours_vjp(causal=True)

fns = {}
for g in (0, 8):
    fa._BWD_HEAD_GROUP = g
    fns[f"dkdv group {g}"] = jax.jit(lambda *a: ours(*a))
    jax.block_until_ready(fns[f"dkdv group {g}"](q, k, v, do))
attn = ba.implementations()["cuDNN"]
fns["cuDNN"] = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: attn(*a, True), q, k, v)[1](do))
total = 3.5 * ba.flops(*shape, True)
res: dict[str, list[float]] = {}
names = list(fns)
for r in range(ROUNDS):
    for n in names[r % 3 :] + names[: r % 3]:
        for warm in (0.3, 0.0):
            ba.WARM_S = warm
            ms = ba.timed(fns[n], q, k, v, do, iters=20, repeats=5)
            res.setdefault(f"{n} warm {warm}", []).append(total / ms / 1e9)
print(f"== {shape} causal fwd+bwd TFLOP/s (median of {ROUNDS}; rounds)")
for n, xs in res.items():
    print(f"  {n:26s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))
