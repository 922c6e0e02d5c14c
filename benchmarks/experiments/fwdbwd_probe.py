"""On the GPU (``fwdbwd_ab.sh`` runs it from two builds): ours, forward+backward TFLOP/s at the
harness's main shapes, each timed after the harness's warm-up (steady clock)."""

import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax

for shape in [(4, 4096, 16, 128), (8, 2048, 16, 64)]:
    q, k, v, do = ba.normal_inputs(shape, 1)
    for causal in (False, True):
        f = jax.jit(ba.ours_vjp(causal))
        ms = ba.timed(f, q, k, v, do)
        print(f"{shape} causal={causal}: {3.5 * ba.flops(*shape, causal) / ms / 1e9:.0f} TFLOP/s")
