"""A/B on the GPU, one process (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): the Gluon dK/dV kernel
(``flash_attention_bwd_dkdv_gluon_kernel``) against the warp-specialized Triton one and the
usual one.

1. ``check``: gradients of key and value at odd shapes (GQA, Sq ≠ Sk, cut blocks, causal, soft
   cap) against a float32 reference through ``jax.vjp``, for each Gluon config.
2. ``time``: each dK/dV kernel alone on the same inputs, interleaved rounds, at the harness's
   shapes (D 128: B 4, S 4096, H 16; D 64: B 8, S 2048, H 16), causal and not.

Arguments: the parts (both by default); ``tiny`` shrinks the timed shapes.
"""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
import attrs
import bench_attention as ba
import jax
import jax.numpy as jnp

from ejkernel.modules import BwdParams
from ejkernel_triton import _codegen, _launch
from ejkernel_triton.ops import flash_attention as fa

PARTS = sys.argv[1:] or ["check", "time"]
ROUNDS = 3
GLUON = [] if "nogluon" in PARTS else [(64, 2), (64, 3), (128, 2)]


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def bwd_params(bm, stages):
    return BwdParams(q_blocksize=bm, kv_blocksize=128, num_warps=4, num_stages=stages)


def reference(q, k, v, do, causal, cap):
    """dK, dV of plain float32 attention (bottom-right causal, GQA by repetition)."""
    sq, hq, sk, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]

    def attn(q, k, v):
        k, v = (jnp.repeat(x, hq // hkv, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        if cap:
            s = cap * jnp.tanh(s / cap)
        if causal:
            keep = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
            s = jnp.where(keep, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(jnp.isnan(p), 0.0, p)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    _, vjp = jax.vjp(attn, *f32[:3])
    return vjp(f32[3])[1:]


def prepared(q, k, v, do, causal, cap):
    """The statics, lse and delta the dK/dV kernels take (from our forward)."""
    cfg = fa._default_config(q, k, v, causal)
    out, res = fa._flash_attention_fwd(
        query=q, key=k, value=v, causal=causal, logits_soft_cap=cap, cfg=cfg
    )
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    st = fa._Statics.of(q, k, v, None, causal, None, cap, cfg)
    return st, res["lse"], delta


def inputs(shapes, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(x, s, jnp.float32).astype(jnp.bfloat16) for x, s in zip(ks, shapes)]


if "check" in PARTS:
    cases = [
        ((2, 300, 4, 128), (2, 300, 2, 128), True, None),
        ((2, 300, 4, 128), (2, 300, 2, 128), False, None),
        ((1, 200, 4, 64), (1, 333, 4, 64), True, None),
        ((1, 333, 2, 128), (1, 200, 1, 128), True, 30.0),
        ((1, 256, 2, 64), (1, 256, 2, 64), False, 20.0),
        ((2, 1000, 6, 128), (2, 1000, 2, 128), True, None),
    ]
    for qs, ks, causal, cap in cases:
        q, do = inputs([qs, qs], 1)
        k, v = inputs([ks, ks], 2)
        dk_ref, dv_ref = reference(q, k, v, do, causal, cap)
        st, lse, delta = prepared(q, k, v, do, causal, cap)
        ws_dk, ws_dv = jax.jit(lambda *a: fa._dkdv_ws(st, *a))(q, k, v, do, lse, delta)
        print(
            f"{qs} {ks} causal={causal} cap={cap}: ws dk {rel(ws_dk, dk_ref):.2e} "
            f"dv {rel(ws_dv, dv_ref):.2e}",
            flush=True,
        )
        for bm, stages in GLUON:
            try:
                dk, dv = jax.jit(lambda *a: fa._dkdv_gluon(st, *a, bwd_params(bm, stages)))(
                    q, k, v, do, lse, delta
                )
                print(
                    f"   gluon {bm} s{stages}: dk {rel(dk, dk_ref):.2e} dv {rel(dv, dv_ref):.2e}"
                    f" finite {bool(jnp.isfinite(dk).all() & jnp.isfinite(dv).all())}",
                    flush=True,
                )
            except Exception as e:
                print(
                    f"   gluon {bm} s{stages}: FAIL {type(e).__name__} {str(e)[:400]}", flush=True
                )


if "time" in PARTS:
    shapes = [
        ((4, 4096, 16, 128), True),
        ((4, 4096, 16, 128), False),
        ((8, 2048, 16, 64), True),
        ((8, 2048, 16, 64), False),
    ]
    if "tiny" in PARTS:
        shapes, ROUNDS = [((1, 512, 2, 128), True)], 1
    for shape, causal in shapes:
        b, s, h, d = shape
        q, k, v, do = inputs([shape] * 4, s + d)
        st, lse, delta = prepared(q, k, v, do, causal, None)
        args = (q, k, v, do, lse, delta)
        fns = {"ws": jax.jit(lambda *a: fa._dkdv_ws(st, *a))}
        for bm, stages in GLUON:
            params = bwd_params(bm, stages)
            fns[f"gluon {bm} s{stages}"] = jax.jit(lambda *a, p=params: fa._dkdv_gluon(st, *a, p))
        # the usual kernel at the heuristic's dK/dV config
        usual = attrs.evolve(fa._default_config(q, k, v, causal), warp_specialize=False)
        ust = fa._Statics.of(q, k, v, None, causal, None, None, usual)
        arrays = fa._Arrays.of(q, k, v, None, None, None, None, None)
        call = fa._backward_call(ust, arrays.modes())
        with _codegen.recorded_launches() as rec:
            call(*arrays.launch_args(), do, lse, do)
        dkdv = next(r for r in rec if r.kernel.fn.__name__ == "flash_attention_bwd_dkdv_kernel")
        names = dkdv.kernel.arg_names
        idx = [i for i, a in enumerate(dkdv.args) if getattr(a, "ndim", 0) > 0]
        concrete = {"Q": q, "K": k, "V": v, "DO": do, "Lse": lse, "Delta": delta}

        def run_usual(*xs, dkdv=dkdv, idx=idx):
            a = list(dkdv.args)
            for i, x in zip(idx, xs):
                a[i] = x
            return _launch.launch(
                dkdv.kernel,
                *a,
                out_shape=dkdv.out_shape,
                grid=dkdv.grid,
                num_warps=dkdv.num_warps,
                num_stages=dkdv.num_stages,
                **dkdv.constexprs,
            )

        uargs = [
            concrete.get(names[i], jnp.zeros(dkdv.args[i].shape, dkdv.args[i].dtype)) for i in idx
        ]
        usual_f = jax.jit(run_usual)
        outs = {n: jax.block_until_ready(f(*args)) for n, f in fns.items()}
        outs["usual"] = jax.block_until_ready(usual_f(*uargs))
        for n, o in outs.items():
            print(
                f"  err {n:16s} dk {rel(o[0], outs['ws'][0]):.2e} dv {rel(o[1], outs['ws'][1]):.2e}"
            )
        total = 8 * b * h * s * s * d / (2 if causal else 1)
        res = {}
        for _ in range(ROUNDS):
            for n, f in fns.items():
                res.setdefault(n, []).append(total / ba.timed(f, *args, iters=10, repeats=3) / 1e9)
            res.setdefault("usual", []).append(
                total / ba.timed(usual_f, *uargs, iters=10, repeats=3) / 1e9
            )
        print(f"== dK/dV {shape} causal={causal} TFLOP/s (median; rounds)", flush=True)
        for n, xs in res.items():
            print(f"  {n:16s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))
