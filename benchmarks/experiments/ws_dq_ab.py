"""A/B on the GPU, one process, interleaved rounds (run from the repository root with ours
installed, as ``benchmarks/gpu_attention.sh`` does):

1. the dQ kernel alone: ``flash_attention_bwd_dq_ws_kernel`` at several block sizes against the
   usual dQ kernel (same inputs; errors against the usual kernel);
2. the causal warp-specialized forward: the mask variants of ``ws_causal_probe.py``, launch
   order, against the library kernel and cuDNN;
3. forward+backward through the op: warp specialization on (now with the dQ kernel too) and
   off, against cuDNN and tokamax's Triton attention.

Parts (arguments): ``dq``, ``causal``, ``persist`` (the probe's persistent forward), ``pers2``
(the persistent library forward against ``ws_one_tile_probe.py``), ``op``; ``tiny`` for a dry
run on a CPU. Results: ``benchmarks/results/triton-ws-*-h100-2026-11-23-s9*.log``. The
persistent dQ rows of ``…-persistent-ab-…`` came from a persistent dQ kernel that was not kept
(64-key steps returned NaN, 128-key steps lost 20 %); ``pers2`` now times the library's."""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import attrs
import bench_attention as ba
import jax
import jax.numpy as jnp
import numpy as np
import ws_causal_probe as probe
import ws_one_tile_probe as one_tile

import ejkernel
from ejkernel_triton import _codegen, _launch
from ejkernel_triton._kernel_cache import GLOBAL_SCRATCH_BYTES
from ejkernel_triton.kernels.flash_attention import flash_attention_bwd_dq_ws_kernel
from ejkernel_triton.ops import flash_attention as fa

ROUNDS = 3
PARTS = sys.argv[1:] or ["dq", "causal", "op"]


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def race(title, fns, args, total):
    res = {}
    for _ in range(ROUNDS):
        for name, f in fns.items():
            ms = ba.timed(f, *args, iters=10, repeats=3)
            res.setdefault(name, []).append(total / ms / 1e9)
    print(f"== {title} TFLOP/s (median of {ROUNDS} rounds; rounds)", flush=True)
    for name, xs in res.items():
        rounds = " ".join(f"{x:.0f}" for x in xs)
        print(f"  {name:28s} {statistics.median(xs):7.1f}  {rounds}", flush=True)


def inputs(shape, n, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), n)
    return [jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks]


SHAPES = [
    ((4, 4096, 16, 128), False),
    ((4, 4096, 16, 128), True),
    ((8, 2048, 16, 64), False),
    ((8, 2048, 16, 64), True),
]
if "tiny" in PARTS:  # a dry run on a CPU, in the interpreter
    SHAPES, ROUNDS = [((1, 256, 2, 64), True), ((1, 256, 2, 64), False)], 1

if "dq" in PARTS:
    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v, do = inputs(shape, 4, s + d)
        cfg = attrs.evolve(fa._default_config(q, k, v), warp_specialize=False)
        out, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=causal, cfg=cfg)
        with _codegen.recorded_launches() as rec:
            fa._flash_attention_bwd(res, do, cfg=cfg, causal=causal)
        usual = rec[[r.kernel.fn.__name__ for r in rec].index("flash_attention_bwd_dq_kernel")]
        scale = d**-0.5
        sc = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
        if causal:
            sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
        lse = jax.nn.logsumexp(sc, axis=-1) * 1.4426950408889634
        del sc
        delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))
        # the usual dQ kernel takes the forward's output and computes delta itself (since the
        # eleventh session; the WS kernels below still take delta)
        concrete = {0: q, 1: k, 2: v, 7: do, 8: lse, 9: out}
        idx = [i for i, a in enumerate(usual.args) if getattr(a, "ndim", 0) > 0]
        arrs = [concrete.get(i, jnp.zeros(usual.args[i].shape, usual.args[i].dtype)) for i in idx]

        def run_usual(*xs):
            args = list(usual.args)
            for i, x in zip(idx, xs):
                args[i] = x
            return _launch.launch(
                usual.kernel,
                *args,
                out_shape=usual.out_shape,
                grid=usual.grid,
                num_warps=usual.num_warps,
                num_stages=usual.num_stages,
                **usual.constexprs,
            )[0]

        uj = jax.jit(run_usual)
        name = (
            f"usual {usual.constexprs['BLOCK_M']}x{usual.constexprs['BLOCK_N']} w{usual.num_warps}"
        )
        fns = {name: lambda: uj(*arrs)}
        for bm, bn, st in ((128, 128, 2), (128, 64, 2), (64, 128, 2), (128, 128, 3)):

            def ws(q, k, v, do, lse, delta, bm=bm, bn=bn, st=st):
                grid = (s // bm, b * h)
                return _launch.launch(
                    flash_attention_bwd_dq_ws_kernel,
                    q,
                    k,
                    v,
                    do,
                    lse,
                    delta,
                    np.float32(scale),
                    np.float32(1.0),
                    b,
                    s,
                    s,
                    h,
                    h,
                    s,
                    out_shape=[
                        jax.ShapeDtypeStruct(q.shape, q.dtype),
                        jax.ShapeDtypeStruct((grid[0] * grid[1] * GLOBAL_SCRATCH_BYTES,), jnp.int8),
                    ],
                    grid=grid,
                    num_warps=4,
                    num_stages=st,
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    HEAD_DIM=d,
                    CAUSAL=causal,
                    SOFT_CAP=False,
                    EVEN_K=True,
                )[0]

            wj = jax.jit(ws)
            fns[f"ws {bm}x{bn} s{st}"] = lambda wj=wj: wj(q, k, v, do, lse, delta)
        outs = {}
        for n, f in list(fns.items()):
            try:
                outs[n] = jax.block_until_ready(f())
            except Exception as e:
                print("FAIL", n, type(e).__name__, str(e)[:400], flush=True)
                fns.pop(n)
        ref = outs[name]
        for n, o in outs.items():
            nan = bool(jnp.isnan(o.astype(jnp.float32)).any())
            print(f"  err vs usual {n:24s} dq {rel(o, ref):.2e} nan={nan}", flush=True)
        total = 6.0 * b * h * s * s * d / (2 if causal else 1)  # three matmuls
        race(f"dQ alone {shape} causal={causal}", fns, (), total)

if "causal" in PARTS:
    impls = ba.implementations()
    for shape in ((4, 4096, 16, 128), (8, 2048, 16, 64)):
        b, s, h, d = shape
        q, k, v = inputs(shape, 3, s + d)
        fns = {
            "library ws (op)": jax.jit(
                lambda q, k, v: ejkernel.flash_attention(
                    q,
                    k,
                    v,
                    causal=True,
                    platform="triton",
                    cfg=fa.FlashAttentionConfig(fwd_params=fa._WS_FWD, warp_specialize=True),
                )
            ),
            "cuDNN": jax.jit(lambda q, k, v: impls["cuDNN"](q, k, v, True)),
        }
        for variant, reverse in ((0, False), (0, True), (6, False), (6, True), (7, False)):

            def run(q, k, v, variant=variant, reverse=reverse):
                grid = (s // 128, b * h)
                return _launch.launch(
                    probe.fwd_causal_probe,
                    q,
                    k,
                    v,
                    np.float32(d**-0.5 * 1.4426950408889634),
                    b,
                    s,
                    h,
                    out_shape=[
                        jax.ShapeDtypeStruct(q.shape, q.dtype),
                        jax.ShapeDtypeStruct((grid[0] * grid[1] * GLOBAL_SCRATCH_BYTES,), jnp.int8),
                    ],
                    grid=grid,
                    num_warps=4,
                    num_stages=2,
                    HEAD_DIM=d,
                    BLOCK_M=128,
                    BLOCK_N=128,
                    VARIANT=variant,
                    REVERSE=reverse,
                )[0]

            fns[f"probe v{variant}{' rev' if reverse else ''}"] = jax.jit(run)
        outs = {}
        for n, f in list(fns.items()):
            try:
                outs[n] = jax.block_until_ready(f(q, k, v))
            except Exception as e:
                print("FAIL", n, type(e).__name__, str(e)[:400], flush=True)
                fns.pop(n)
        for n, o in outs.items():
            print(f"  err vs cuDNN {n:24s} {rel(o, outs['cuDNN']):.2e}", flush=True)
        race(f"causal forward {shape}", fns, (q, k, v), ba.flops(b, s, h, d, True))

if "persist" in PARTS:
    impls = ba.implementations()
    n_sm = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v = inputs(shape, 3, s + d)
        fns = {
            "library ws (op)": jax.jit(
                lambda q, k, v: ejkernel.flash_attention(
                    q,
                    k,
                    v,
                    causal=causal,
                    platform="triton",
                    cfg=fa.FlashAttentionConfig(fwd_params=fa._WS_FWD, warp_specialize=True),
                )
            ),
            "library default (op)": jax.jit(
                lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=causal, platform="triton")
            ),
        }
        if jax.default_backend() == "gpu":
            fns["cuDNN"] = jax.jit(lambda q, k, v: impls["cuDNN"](q, k, v, causal))
        else:
            fns["XLA"] = jax.jit(lambda q, k, v: impls["XLA"](q, k, v, causal))
        for programs in (n_sm, 2 * n_sm):

            def run(q, k, v, programs=programs):
                grid = (programs,)
                return _launch.launch(
                    probe.fwd_causal_persistent_probe,
                    q,
                    k,
                    v,
                    np.float32(d**-0.5 * 1.4426950408889634),
                    b,
                    s,
                    h,
                    out_shape=[
                        jax.ShapeDtypeStruct(q.shape, q.dtype),
                        jax.ShapeDtypeStruct((programs * GLOBAL_SCRATCH_BYTES,), jnp.int8),
                    ],
                    grid=grid,
                    num_warps=4,
                    num_stages=2,
                    HEAD_DIM=d,
                    BLOCK_M=128,
                    BLOCK_N=128,
                    SPLIT=False,
                    BRANCH=False,
                    CAUSAL=causal,
                )[0]

            fns[f"persistent x{programs}"] = jax.jit(run)
        outs = {}
        for n, f in list(fns.items()):
            try:
                outs[n] = jax.block_until_ready(f(q, k, v))
            except Exception as e:
                print("FAIL", n, type(e).__name__, str(e)[:400], flush=True)
                fns.pop(n)
        ref = outs.get("cuDNN", next(iter(outs.values())))
        for n, o in outs.items():
            print(f"  err vs cuDNN {n:24s} {rel(o, ref):.2e}", flush=True)
        race(f"forward {shape} causal={causal}", fns, (q, k, v), ba.flops(b, s, h, d, causal))

if "pers2" in PARTS:  # the persistent library kernels against the one-tile ones they replaced
    impls = ba.implementations()
    from ejkernel_triton.kernels import flash_attention as kern

    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v, do = inputs(shape, 4, s + d)
        scale = d**-0.5

        def scratch(n):
            return jax.ShapeDtypeStruct((n * GLOBAL_SCRATCH_BYTES,), jnp.int8)

        def fwd_one(q, k, v):
            grid = (s // 128, b * h)
            return _launch.launch(
                one_tile.fwd_ws_one_tile,
                q,
                k,
                v,
                np.float32(scale),
                np.float32(1.0),
                b,
                s,
                s,
                h,
                h,
                out_shape=[
                    jax.ShapeDtypeStruct(q.shape, q.dtype),
                    jax.ShapeDtypeStruct((b, h, s), jnp.float32),
                    scratch(grid[0] * grid[1]),
                ],
                grid=grid,
                num_warps=4,
                num_stages=2,
                HEAD_DIM=d,
                BLOCK_M=128,
                BLOCK_N=128,
                CAUSAL=causal,
                SOFT_CAP=False,
                EVEN_K=True,
            )[0]

        cfg = fa.FlashAttentionConfig(fwd_params=fa._WS_FWD, warp_specialize=True)
        fns = {
            "fwd persistent (op)": jax.jit(
                lambda q, k, v: ejkernel.flash_attention(
                    q, k, v, causal=causal, platform="triton", cfg=cfg
                )
            ),
            "fwd one tile": jax.jit(fwd_one),
            "cuDNN": jax.jit(lambda q, k, v: impls["cuDNN"](q, k, v, causal)),
        }
        outs = {n: jax.block_until_ready(f(q, k, v)) for n, f in fns.items()}
        for n, o in outs.items():
            print(f"  err vs cuDNN {n:24s} {rel(o, outs['cuDNN']):.2e}", flush=True)
        race(f"forward {shape} causal={causal}", fns, (q, k, v), ba.flops(b, s, h, d, causal))

        out = outs["cuDNN"]
        sc = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
        if causal:
            sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
        lse = jax.nn.logsumexp(sc, axis=-1) * 1.4426950408889634
        del sc
        delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))

        def dq_one(q, k, v, do, lse, delta):
            grid = (s // 128, b * h)
            return _launch.launch(
                kern.flash_attention_bwd_dq_ws_kernel,
                q,
                k,
                v,
                do,
                lse,
                delta,
                np.float32(scale),
                np.float32(1.0),
                b,
                s,
                s,
                h,
                h,
                s,
                out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), scratch(grid[0] * grid[1])],
                grid=grid,
                num_warps=4,
                num_stages=2,
                HEAD_DIM=d,
                BLOCK_M=128,
                BLOCK_N=128,
                CAUSAL=causal,
                SOFT_CAP=False,
                EVEN_K=True,
            )[0]

        dfns = {"dq one tile 128x128 s2": jax.jit(dq_one)}
        douts = {}
        for n, f in list(dfns.items()):
            try:
                douts[n] = jax.block_until_ready(f(q, k, v, do, lse, delta))
            except Exception as e:
                print("FAIL", n, type(e).__name__, str(e)[:400], flush=True)
                dfns.pop(n)
        first = next(iter(douts.values()))
        for n, o in douts.items():
            nan = bool(jnp.isnan(o.astype(jnp.float32)).any())
            print(f"  err vs one tile {n:24s} {rel(o, first):.2e} nan={nan}", flush=True)
        race(
            f"dQ alone {shape} causal={causal}",
            dfns,
            (q, k, v, do, lse, delta),
            6.0 * b * h * s * s * d / (2 if causal else 1),
        )

if "op" in PARTS:
    impls = ba.implementations()
    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v = inputs(shape, 3, s + d)
        base = fa._default_config(q, k, v)

        def grad_of(attn):
            def loss(q, k, v):
                return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

        def tri(cfg):
            return lambda q, k, v: ejkernel.flash_attention(
                q, k, v, causal=causal, platform="triton", cfg=cfg
            )

        fns = {
            "ours ws (new dQ)": grad_of(
                tri(attrs.evolve(base, fwd_params=fa._WS_FWD, warp_specialize=True))
            ),
            "ours usual": grad_of(tri(attrs.evolve(base, warp_specialize=False))),
            "cuDNN": grad_of(lambda q, k, v: impls["cuDNN"](q, k, v, causal)),
            "tokamax triton": grad_of(lambda q, k, v: impls["tokamax triton"](q, k, v, causal)),
        }
        outs = {}
        for n, f in list(fns.items()):
            try:
                outs[n] = jax.block_until_ready(f(q, k, v))
            except Exception as e:
                print("FAIL", n, type(e).__name__, str(e)[:400], flush=True)
                fns.pop(n)
        for n, o in outs.items():
            errs = " ".join(f"{rel(a, r):.2e}" for a, r in zip(o, outs["cuDNN"]))
            print(f"  err vs cuDNN {n:24s} dq dk dv {errs}", flush=True)
        race(f"fwd+bwd {shape} causal={causal}", fns, (q, k, v), 3.5 * ba.flops(b, s, h, d, causal))
