"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): the D 64 forward, (8, 2048, 16, 64), with each forward
config of the Triton config space (and the warp-specialized kernel) against cuDNN, in
rotating rounds, each timed after the harness's warm-up: is there a heuristic that keeps the
forward ≥ 0.9× cuDNN in every round?"""

import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax

import ejkernel
from ejkernel._params import FwdParams
from ejkernel_triton.ops.flash_attention import _WS_FWD, FlashAttentionConfig

ROUNDS = 3
shape = (8, 2048, 16, 64)
q, k, v, _ = ba.normal_inputs(shape, 4)
cfgs = {
    f"{bq}x{bk} w{w} s{s}": FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
    )
    for bq, bk, w, s in [
        (64, 64, 4, 3),
        (128, 128, 8, 3),
        (128, 64, 8, 4),
        (128, 64, 8, 3),
        (64, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 64, 4, 4),
        (64, 32, 4, 3),
    ]
}
cfgs["ws"] = FlashAttentionConfig(fwd_params=_WS_FWD, warp_specialize=True)
cudnn = ba.implementations()["cuDNN"]
for causal in (False, True):
    fns = {
        n: jax.jit(
            lambda q, k, v, c=c, causal=causal: ejkernel.flash_attention(
                q, k, v, causal=causal, platform="triton", cfg=c
            )
        )
        for n, c in cfgs.items()
    }
    fns["cuDNN"] = jax.jit(lambda q, k, v, causal=causal: cudnn(q, k, v, causal))
    res = ba.rotating_rounds(fns, (q, k, v), ROUNDS, ba.flops(*shape, causal) / 1e9)
    ba.print_rounds(f"{shape} causal={causal} forward, {ROUNDS} rounds", res)
