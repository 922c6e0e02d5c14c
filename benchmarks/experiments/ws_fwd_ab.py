"""A/B on the GPU through the op: the warp-specialized Triton forward (``warp_specialize=True``)
against the usual one and cuDNN, one process, interleaved rounds, errors against cuDNN.
Install ours as ``benchmarks/gpu_attention.sh`` does, then run from the repository root.
Results: ``benchmarks/results/triton-ws-fwd-ab-h100-2026-11-23-s8.log``."""

import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax
import jax.numpy as jnp

import ejkernel
from ejkernel._params import FwdParams
from ejkernel_triton.ops import flash_attention as fa


def tri(bq, bk, w, s, ws=False):
    cfg = fa.FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s),
        warp_specialize=ws,
    )
    return lambda q, k, v, causal: ejkernel.flash_attention(
        q, k, v, causal=causal, platform="triton", cfg=cfg
    )


impls = ba.implementations()
V128 = {
    "tl 128x128w8s3": tri(128, 128, 8, 3),
    "ws 128x128 s2": tri(128, 128, 4, 2, True),
    "ws 128x64 s3": tri(128, 64, 4, 3, True),
    "ws 128x64 s4": tri(128, 64, 4, 4, True),
    "cuDNN": impls["cuDNN"],
}
V64 = {
    "tl 128x64w4s3": tri(128, 64, 4, 3),
    "ws 128x128 s2": tri(128, 128, 4, 2, True),
    "ws 128x128 s3": tri(128, 128, 4, 3, True),
    "ws 128x64 s4": tri(128, 64, 4, 4, True),
    "ws 256x64 s3": tri(256, 64, 4, 3, True),
    "ws 256x128 s2": tri(256, 128, 4, 2, True),
    "cuDNN": impls["cuDNN"],
}
ROUNDS = 3
for shape, causal in [
    ((4, 4096, 16, 128), False),
    ((4, 4096, 16, 128), True),
    ((8, 2048, 16, 64), False),
    ((8, 2048, 16, 64), True),
]:
    b, s, h, d = shape
    V = V128 if d == 128 else V64
    ks = jax.random.split(jax.random.PRNGKey(s + d), 3)
    q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
    fns, outs = {}, {}
    for name, attn in V.items():
        try:
            f = jax.jit(lambda q, k, v, attn=attn, causal=causal: attn(q, k, v, causal))
            outs[name] = jax.block_until_ready(f(q, k, v))
            fns[name] = f
        except Exception as e:
            print("FAIL", name, shape, causal, type(e).__name__, str(e)[:600], flush=True)
    ref = outs.get("cuDNN")
    for name, o in outs.items():
        err = float(
            jnp.linalg.norm(o.astype(jnp.float32) - ref.astype(jnp.float32))
            / jnp.linalg.norm(ref.astype(jnp.float32))
        )
        print(
            f"  err vs cuDNN {name:16s} {err:.2e} nan={bool(jnp.isnan(o.astype(jnp.float32)).any())}",
            flush=True,
        )
    total = ba.flops(b, s, h, d, causal)
    res = {}
    for _r in range(ROUNDS):
        for name, f in fns.items():
            ms = ba.timed(f, q, k, v, iters=10, repeats=3)
            res.setdefault(name, []).append(total / ms / 1e9)
    print(f"== fwd {shape} causal={causal} TFLOP/s", flush=True)
    for name, xs in res.items():
        print(
            f"  {name:16s} {statistics.median(xs):7.1f}  {' '.join(f'{x:.0f}' for x in xs)}",
            flush=True,
        )
