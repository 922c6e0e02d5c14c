"""A/B on the GPU: the dK/dV kernel written for Triton's Hopper warp specialization (the probe
that became ``flash_attention_bwd_dkdv_ws_kernel``; H = Hkv, Sq = Sk) against ours, same inputs,
interleaved rounds. The probe kernel is ``ws_dkdv_probe.py``; run from the repository root.
Results: ``benchmarks/results/triton-ws-dkdv-ab-h100-2026-11-23-s8.log``."""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import bench_attention as ba
import jax
import jax.numpy as jnp
import numpy as np
import ws_dkdv_probe as ws_bwd

from ejkernel_triton import _codegen, _launch
from ejkernel_triton._kernel_cache import GLOBAL_SCRATCH_BYTES
from ejkernel_triton.ops import flash_attention as fa

for shape, causal in [
    ((4, 4096, 16, 128), False),
    ((4, 4096, 16, 128), True),
    ((8, 2048, 16, 64), False),
]:
    b, s, h, d = shape
    ks = jax.random.split(jax.random.PRNGKey(s + d), 4)
    q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
    cfg = fa._default_config(q, k, v)
    out, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=causal, cfg=cfg)
    with _codegen.recorded_launches() as rec:
        fa._flash_attention_bwd(res, do, cfg=cfg, causal=causal)
    names = [r.kernel.fn.__name__ for r in rec]
    dkdv = rec[names.index("flash_attention_bwd_dkdv_kernel")]
    scale = d**-0.5
    sc = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
    lse = jax.nn.logsumexp(sc, axis=-1) * 1.4426950408889634
    del sc
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))
    concrete = {0: q, 1: k, 2: v, 7: do, 8: lse, 9: delta}
    fns = {}
    arr_idx = [i for i, a in enumerate(dkdv.args) if getattr(a, "ndim", 0) > 0]
    arrs = [concrete.get(i, jnp.zeros(dkdv.args[i].shape, dkdv.args[i].dtype)) for i in arr_idx]
    print("arrays at", arr_idx, [a.shape for a in arrs], flush=True)

    def ours(*xs, dkdv=dkdv):
        args = list(dkdv.args)
        for i, x in zip(arr_idx, xs):
            args[i] = x
        return _launch.launch(
            dkdv.kernel,
            *args,
            out_shape=dkdv.out_shape,
            grid=dkdv.grid,
            num_warps=dkdv.num_warps,
            num_stages=dkdv.num_stages,
            **dkdv.constexprs,
        )

    ours_j = jax.jit(ours)
    fns[
        f"ours {dkdv.constexprs.get('BLOCK_M')}x{dkdv.constexprs.get('BLOCK_N')} w{dkdv.num_warps}"
    ] = lambda q, k, v: ours_j(*arrs)
    for bm, bn, st in ((64, 128, 2), (64, 128, 3), (32, 128, 2)):

        def probe(q, k, v, do, lse, delta, bm=bm, bn=bn, st=st):
            grid = (s // bn, b * h)
            dk, dv, _ = _launch.launch(
                ws_bwd.bwd_dkdv_ws,
                q,
                k,
                v,
                do,
                lse,
                delta,
                np.float32(d**-0.5),
                b,
                s,
                s,
                h,
                h,
                out_shape=[
                    jax.ShapeDtypeStruct(k.shape, k.dtype),
                    jax.ShapeDtypeStruct(v.shape, v.dtype),
                    jax.ShapeDtypeStruct((grid[0] * grid[1] * GLOBAL_SCRATCH_BYTES,), jnp.int8),
                ],
                grid=grid,
                num_warps=4,
                num_stages=st,
                HEAD_DIM=d,
                BLOCK_M=bm,
                BLOCK_N=bn,
                CAUSAL=causal,
            )
            return dk, dv

        pj = jax.jit(probe)
        fns[f"ws {bm}x{bn} s{st}"] = lambda q, k, v, pj=pj: pj(q, k, v, do, lse, delta)
    outs = {}
    for name, f in list(fns.items()):
        try:
            outs[name] = jax.block_until_ready(f(q, k, v))
        except Exception as e:
            print("FAIL", name, type(e).__name__, str(e)[:500], flush=True)
            fns.pop(name)
    ref = outs[next(iter(outs))]
    for name, o in outs.items():
        errs = [
            float(
                jnp.linalg.norm(a.astype(jnp.float32) - r.astype(jnp.float32))
                / jnp.linalg.norm(r.astype(jnp.float32))
            )
            for a, r in zip(o[:2], ref[:2])
        ]
        print(f"  err vs ours {name:18s} dk {errs[0]:.2e} dv {errs[1]:.2e}", flush=True)
    total = 8.0 * b * h * s * s * d / (2 if causal else 1)
    r = {}
    for _ in range(3):
        for name, f in fns.items():
            ms = ba.timed(f, q, k, v, iters=10, repeats=3)
            r.setdefault(name, []).append(total / ms / 1e9)
    print(f"== dK/dV {shape} causal={causal} TFLOP/s", flush=True)
    for name, xs in r.items():
        print(
            f"  {name:18s} {statistics.median(xs):7.1f}  {' '.join(f'{x:.0f}' for x in xs)}",
            flush=True,
        )
