"""On the GPU: the Gluon ping-pong forward (``ejkernel_triton.kernels.flash_attention_hopper``,
launched directly with any ring) checked against a
float32 reference at odd shapes, then timed against our Triton forwards and cuDNN in one
process, interleaved rounds (median TFLOP/s). Run from the repository root with ours and the
anchors installed as ``benchmarks/gpu_attention.sh`` does.

``python benchmarks/experiments/gluon_pingpong_ab.py [check] [time]``
"""

import functools
import math
import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import bench_attention as ba
import jax
import jax.numpy as jnp
import numpy as np

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel_triton import _launch
from ejkernel_triton._kernel_cache import GLOBAL_SCRATCH_BYTES
from ejkernel_triton.kernels.flash_attention_hopper import flash_attention_fwd_pingpong_kernel
from ejkernel_triton.ops import flash_attention as fa

LOG2E = 1.4426950408889634


def pingpong(bn=128, stages=2):
    def attn(q, k, v, causal, with_lse=False):
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        grid = (math.ceil(sq / 128), b * h)
        out, lse, _ = _launch.launch(
            flash_attention_fwd_pingpong_kernel,
            q,
            k,
            v,
            np.float32(d**-0.5),
            np.float32(1.0),
            b,
            sq,
            sk,
            h,
            hk,
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, h, sq), jnp.float32),
                jax.ShapeDtypeStruct((grid[0] * grid[1] * GLOBAL_SCRATCH_BYTES,), jnp.int8),
            ],
            grid=grid,
            num_warps=4,
            num_stages=1,
            HEAD_DIM=d,
            CAUSAL=causal,
            SOFT_CAP=False,
            BLOCK_N=bn,
            STAGES=stages,
            EVEN_K=sk % bn == 0,
        )
        return (out, lse) if with_lse else out

    return attn


def ours(ws):
    def attn(q, k, v, causal):
        cfg = None
        if ws:
            cfg = fa.FlashAttentionConfig(
                fwd_params=FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2),
                bwd_params=BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=2),
                warp_specialize=True,
            )
        return ejkernel.flash_attention(q, k, v, causal=causal, platform="triton", cfg=cfg)

    return attn


def reference(q, k, v, causal):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


def check():
    cases = [
        ((2, 1000, 8, 128), (1500, 2), False),
        ((2, 1000, 8, 128), (1500, 2), True),
        ((1, 300, 4, 128), (200, 1), True),  # Sq > Sk: empty rows
        ((1, 256, 4, 64), (256, 4), True),
        ((1, 37, 2, 128), (37, 2), False),
        ((3, 520, 4, 64), (777, 2), True),
    ]
    for (b, sq, h, d), (sk, hk), causal in cases:
        for bn, st in [(128, 2), (64, 3)]:
            ks = jax.random.split(jax.random.PRNGKey(sq + sk + d), 3)
            q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(jnp.bfloat16)
            k = jax.random.normal(ks[1], (b, sk, hk, d), jnp.float32).astype(jnp.bfloat16)
            v = jax.random.normal(ks[2], (b, sk, hk, d), jnp.float32).astype(jnp.bfloat16)
            try:
                out, lse = jax.jit(
                    functools.partial(pingpong(bn, st), causal=causal, with_lse=True)
                )(q, k, v)
                ro, rl = reference(q, k, v, causal)
                err = float(jnp.linalg.norm(out.astype(jnp.float32) - ro) / jnp.linalg.norm(ro))
                finite = jnp.isfinite(rl)
                lerr = float(jnp.max(jnp.where(finite, jnp.abs(lse / LOG2E - rl), 0.0)))
                empty_ok = bool(jnp.all(jnp.where(finite, True, lse > 1e38)))
                print(
                    f"check {(b, sq, h, d)} sk={sk} hk={hk} causal={causal} bn={bn} st={st}: "
                    f"out rel err {err:.2e}, lse max err {lerr:.2e}, empty rows ok {empty_ok}, "
                    f"nan {bool(jnp.isnan(out.astype(jnp.float32)).any())}",
                    flush=True,
                )
            except Exception as e:
                print(
                    "FAIL check",
                    (b, sq, h, d),
                    sk,
                    causal,
                    bn,
                    st,
                    type(e).__name__,
                    str(e)[:2000],
                    flush=True,
                )


def time_all(rounds=3):
    impls = ba.implementations()
    V = {
        "pingpong bn128 st2": pingpong(128, 2),
        "pingpong bn64 st3": pingpong(64, 3),
        "pingpong bn128 st3": pingpong(128, 3),
        "op, warp_specialize": ours(True),
        "tl heuristic": ours(False),
        "cuDNN": impls["cuDNN"],
    }
    for shape, causal in [
        ((4, 4096, 16, 128), False),
        ((4, 4096, 16, 128), True),
        ((8, 2048, 16, 64), False),
        ((8, 2048, 16, 64), True),
    ]:
        b, s, h, d = shape
        ks = jax.random.split(jax.random.PRNGKey(s + d), 3)
        q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
        fns, outs = {}, {}
        for name, attn in V.items():
            if d == 64 and name.startswith("op, warp"):
                continue
            try:
                f = jax.jit(lambda q, k, v, attn=attn, causal=causal: attn(q, k, v, causal))
                outs[name] = jax.block_until_ready(f(q, k, v))
                fns[name] = f
            except Exception as e:
                print("FAIL", name, shape, causal, type(e).__name__, str(e)[:1500], flush=True)
        ref = outs.get("cuDNN")
        for name, o in outs.items():
            if ref is not None and name != "cuDNN":
                err = float(
                    jnp.linalg.norm(o.astype(jnp.float32) - ref.astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32))
                )
                print(f"  err vs cuDNN {name:22s} {err:.2e}", flush=True)
        total = ba.flops(b, s, h, d, causal)
        res = {}
        for _ in range(rounds):
            for name, f in fns.items():
                ms = ba.timed(f, q, k, v, iters=10, repeats=3)
                res.setdefault(name, []).append(total / ms / 1e9)
        print(f"== fwd {shape} causal={causal} TFLOP/s", flush=True)
        for name, xs in res.items():
            print(
                f"  {name:22s} {statistics.median(xs):7.1f}  {' '.join(f'{x:.0f}' for x in xs)}",
                flush=True,
            )


if __name__ == "__main__":
    parts = sys.argv[1:] or ["check", "time"]
    if "check" in parts:
        check()
    if "time" in parts:
        time_all()
