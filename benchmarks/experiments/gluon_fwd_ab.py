"""A/B on the GPU: the Gluon forward experiment against our Triton forward, cuDNN and tokamax,
one process, interleaved rounds (median TFLOP/s). Run from the repository root with ours and
the anchors installed as ``benchmarks/gpu_attention.sh`` does, and ``TRITON_CACHE_DIR`` set.
"""

import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import bench_attention as ba
import gluon_fwd as g
import jax
import jax.numpy as jnp
import numpy as np

import ejkernel
from ejkernel._params import FwdParams
from ejkernel_triton import _launch
from ejkernel_triton.ops import flash_attention as fa


def gluon_attn(bn, st, warps=8, bm=128):
    def attn(q, k, v, causal):
        b, s, h, d = q.shape
        out, _lse = _launch.launch(
            g.flash_attention_fwd_gluon,
            q,
            k,
            v,
            np.float32(d**-0.5),
            s,
            k.shape[1],
            h,
            k.shape[2],
            *fa._strides(q.shape, 16),
            *fa._strides(k.shape, 16),
            *fa._strides(v.shape, 16),
            *fa._strides(q.shape, 16),
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, h, s), jnp.float32),
            ],
            grid=(s // bm, b * h),
            num_warps=warps,
            num_stages=1,
            HEAD_DIM=d,
            BLOCK_M=bm,
            BLOCK_N=bn,
            STAGES=st,
            CAUSAL=causal,
            ALIGN=16,
        )
        return out

    return attn


def tri(bq, bk, w, s):
    def attn(q, k, v, causal):
        cfg = fa.FlashAttentionConfig(
            fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        )
        return ejkernel.flash_attention(q, k, v, causal=causal, platform="triton", cfg=cfg)

    return attn


impls = ba.implementations()
V = {
    "tl 128x128w8s3": tri(128, 128, 8, 3),
    "tl 64x64w4s3": tri(64, 64, 4, 3),
    "gluon bn128 st3": gluon_attn(128, 3),
    "gluon bn64 st4": gluon_attn(64, 4),
    "gluon bn64 st3": gluon_attn(64, 3),
    "cuDNN": impls["cuDNN"],
    "tokamax mosaic": impls.get("tokamax mosaic"),
}
V = {k: v for k, v in V.items() if v is not None}
ROUNDS = 3
for shape, causal in [
    ((4, 4096, 16, 128), False),
    ((4, 4096, 16, 128), True),
    ((8, 2048, 16, 64), False),
    ((8, 2048, 16, 64), True),
]:
    b, s, h, d = shape
    ks = jax.random.split(jax.random.PRNGKey(s + d), 3)
    q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
    fns, ref = {}, None
    for name, attn in V.items():
        try:
            f = jax.jit(lambda q, k, v, attn=attn, causal=causal: attn(q, k, v, causal))
            o = jax.block_until_ready(f(q, k, v))
            fns[name] = f
            if name == "cuDNN":
                ref = o
            if name.startswith("gluon") or name.startswith("tl"):
                fns[name + "__out"] = o
        except Exception as e:
            print("FAIL", name, shape, causal, type(e).__name__, str(e)[:1500], flush=True)
    if ref is not None:
        for name in list(fns):
            if name.endswith("__out"):
                o = fns.pop(name)
                err = float(
                    jnp.linalg.norm(o.astype(jnp.float32) - ref.astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32))
                )
                print(
                    f"  err vs cuDNN {name[:-5]:20s} {err:.2e}  nan={bool(jnp.isnan(o.astype(jnp.float32)).any())}",
                    flush=True,
                )
    fns = {k: v for k, v in fns.items() if not k.endswith("__out")}
    total = ba.flops(b, s, h, d, causal)
    res = {}
    for _r in range(ROUNDS):
        for name, f in fns.items():
            ms = ba.timed(f, q, k, v, iters=10, repeats=3)
            res.setdefault(name, []).append(total / ms / 1e9)
    print(f"== fwd {shape} causal={causal} TFLOP/s", flush=True)
    for name, xs in res.items():
        print(
            f"  {name:20s} {statistics.median(xs):7.1f}  {' '.join(f'{x:.0f}' for x in xs)}",
            flush=True,
        )
