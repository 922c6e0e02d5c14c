"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): the D 64 forward, (8, 2048, 16, 64), with the softmax
scale folded into the exponent (``PLAIN_SCALE``, ``ops.flash_attention._SCALE_IN_EXP``) and
without, at a few forward configs, against cuDNN in rotating rounds, each timed after the
harness's warm-up."""

import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax

import ejkernel
from ejkernel._params import FwdParams
from ejkernel_triton.ops import flash_attention as fa

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
CONFIGS = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3)]
shape = (8, 2048, 16, 64)
q, k, v, _ = ba.normal_inputs(shape, 4)
cudnn = ba.implementations()["cuDNN"]
for causal in (False, True):
    fns = {}
    for fused in (True, False):
        fa._SCALE_IN_EXP = fused  # read when the call is traced: trace each variant now
        for bq, bk, w, s in CONFIGS:
            cfg = fa.FlashAttentionConfig(
                fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
            )
            f = jax.jit(
                lambda q, k, v, c=cfg, causal=causal: ejkernel.flash_attention(
                    q, k, v, causal=causal, platform="triton", cfg=c
                )
            )
            jax.block_until_ready(f(q, k, v))
            fns[f"{'fused' if fused else 'mul'} {bq}x{bk} w{w} s{s}"] = f
    fa._SCALE_IN_EXP = True
    fns["cuDNN"] = jax.jit(lambda q, k, v, causal=causal: cudnn(q, k, v, causal))
    names = list(fns)
    want = fns["cuDNN"](q, k, v).astype("float32")
    for n in names[:-1]:
        err = float(abs(fns[n](q, k, v).astype("float32") - want).max())
        print(f"  {n:22s} max |out - cuDNN's| {err:.2e}", flush=True)
    res = ba.rotating_rounds(fns, (q, k, v), ROUNDS, ba.flops(*shape, causal) / 1e9)
    ba.print_rounds(f"{shape} causal={causal} forward, {ROUNDS} rounds", res)
