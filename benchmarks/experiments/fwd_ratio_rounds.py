"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): the forward's ratio to cuDNN at the harness's main
shapes, in rotating rounds (which of the two runs first alternates), each timed after the
harness's warm-up: how much one harness row's ratio can move."""

import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax

ROUNDS = 6
impls = {"ours": ba.ours("triton"), "cuDNN": ba.implementations()["cuDNN"]}
for shape, causal in [((8, 2048, 16, 64), False), ((8, 2048, 16, 64), True)]:
    q, k, v, _ = ba.normal_inputs(shape, 2)
    fns = {n: jax.jit(lambda q, k, v, f=f, c=causal: f(q, k, v, c)) for n, f in impls.items()}
    res = ba.rotating_rounds(fns, (q, k, v), ROUNDS, ba.flops(*shape, causal) / 1e9)
    ratios = [a / b for a, b in zip(res["ours"], res["cuDNN"], strict=True)]
    print(f"== {shape} causal={causal} forward TFLOP/s, {ROUNDS} rounds")
    for n, xs in res.items():
        print(f"  {n:6s} median {statistics.median(xs):6.1f}: " + " ".join(f"{x:.0f}" for x in xs))
    print(
        f"  ours / cuDNN median {statistics.median(ratios):.3f}: "
        + " ".join(f"{x:.2f}" for x in ratios),
        flush=True,
    )
