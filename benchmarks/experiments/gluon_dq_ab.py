"""A/B on the GPU, one process (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): the Gluon dQ kernel (``flash_attention_bwd_dq_gluon_kernel``)
against the warp-specialized Triton one and the usual one (which also computes delta).

1. ``check``: the gradient of the query at odd shapes (GQA, Sq ≠ Sk, cut blocks, causal, soft
   cap) against a float32 reference through ``jax.vjp``, for each Gluon config.
2. ``time``: each dQ kernel alone on the same inputs, interleaved rounds, at the harness's
   shapes (D 128: B 4, S 4096, H 16; D 64: B 8, S 2048, H 16), causal and not.

Arguments: the parts (both by default).
"""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
import attrs
import bench_attention as ba
import jax
import jax.numpy as jnp

from ejkernel.modules import FwdParams
from ejkernel_triton import _codegen, _launch
from ejkernel_triton.ops import flash_attention as fa

PARTS = sys.argv[1:] or ["check", "time"]
ROUNDS = 3
GLUON = {128: [(64, 2), (64, 3), (128, 2)], 64: [(128, 2), (128, 3), (64, 3)]}


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def dq_params(bn, stages):
    return FwdParams(q_blocksize=128, kv_blocksize=bn, num_warps=4, num_stages=stages)


def reference(q, k, v, do, causal, cap):
    """dQ of plain float32 attention (bottom-right causal, GQA by repetition)."""
    sq, hq, sk, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]

    def attn(q):
        kk, vv = (jnp.repeat(x, hq // hkv, axis=2) for x in f32[1:3])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
        if cap:
            s = cap * jnp.tanh(s / cap)
        if causal:
            keep = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
            s = jnp.where(keep, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(jnp.isnan(p), 0.0, p)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vv)

    _, vjp = jax.vjp(attn, f32[0])
    return vjp(f32[3])[0]


def prepared(q, k, v, do, causal, cap):
    """The statics, output, lse and delta the dQ kernels take (from our forward)."""
    cfg = fa._default_config(q, k, v, causal)
    out, res = fa._flash_attention_fwd(
        query=q, key=k, value=v, causal=causal, logits_soft_cap=cap, cfg=cfg
    )
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    st = fa._Statics.of(q, k, v, None, causal, None, cap, cfg)
    return st, out, res["lse"], delta


def inputs(shapes, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(x, s, jnp.float32).astype(jnp.bfloat16) for x, s in zip(ks, shapes)]


if "check" in PARTS:
    cases = [
        ((2, 300, 4, 128), (2, 300, 2, 128), True, None),
        ((2, 300, 4, 128), (2, 333, 2, 128), False, None),
        ((1, 200, 4, 64), (1, 333, 4, 64), True, None),
        ((1, 333, 2, 128), (1, 200, 1, 128), True, 30.0),
        ((1, 256, 2, 64), (1, 250, 2, 64), False, 20.0),
        ((2, 1000, 6, 128), (2, 1000, 2, 128), True, None),
        ((1, 37, 2, 64), (1, 37, 1, 64), True, None),
    ]
    for qs, ks, causal, cap in cases:
        q, do = inputs([qs, qs], 1)
        k, v = inputs([ks, ks], 2)
        want = reference(q, k, v, do, causal, cap)
        st, _, lse, delta = prepared(q, k, v, do, causal, cap)
        ws = jax.jit(lambda *a: fa._dq_ws(st, *a))(q, k, v, do, lse, delta)
        print(f"{qs} {ks} causal={causal} cap={cap}: ws {rel(ws, want):.2e}", flush=True)
        for bn, stages in GLUON[qs[-1]]:
            try:
                dq = jax.jit(lambda *a: fa._dq_gluon(st, *a, dq_params(bn, stages)))(
                    q, k, v, do, lse, delta
                )
                finite = bool(jnp.isfinite(dq.astype(jnp.float32)).all())
                print(f"   gluon {bn} s{stages}: {rel(dq, want):.2e} finite {finite}", flush=True)
            except Exception as e:
                print(
                    f"   gluon {bn} s{stages}: FAIL {type(e).__name__} {str(e)[:400]}", flush=True
                )


if "time" in PARTS:
    shapes = [
        ((4, 4096, 16, 128), True),
        ((4, 4096, 16, 128), False),
        ((8, 2048, 16, 64), True),
        ((8, 2048, 16, 64), False),
    ]
    for shape, causal in shapes:
        b, s, h, d = shape
        q, k, v, do = inputs([shape] * 4, s + d)
        st, out, lse, delta = prepared(q, k, v, do, causal, None)
        args = (q, k, v, do, lse, delta)
        fns = {"ws": jax.jit(lambda *a: fa._dq_ws(st, *a))}
        for bn, stages in GLUON[d]:
            params = dq_params(bn, stages)
            fns[f"gluon {bn} s{stages}"] = jax.jit(lambda *a, p=params: fa._dq_gluon(st, *a, p))
        # the usual kernel (delta too) at the heuristic's dQ config
        usual = attrs.evolve(fa._default_config(q, k, v, causal), warp_specialize=False)
        ust = fa._Statics.of(q, k, v, None, causal, None, None, usual)
        arrays = fa._Arrays.of(q, k, v, None, None, None, None, None)
        call = fa._backward_call(ust, arrays.modes())
        with _codegen.recorded_launches() as rec:
            call(*arrays.launch_args(), do, lse, out)
        launch = next(r for r in rec if r.kernel.fn.__name__ == "flash_attention_bwd_dq_kernel")
        names = launch.kernel.arg_names
        idx = [i for i, a in enumerate(launch.args) if getattr(a, "ndim", 0) > 0]
        concrete = {"Q": q, "K": k, "V": v, "DO": do, "Lse": lse, "Out": out}

        def run_usual(*xs, launch=launch, idx=idx):
            a = list(launch.args)
            for i, x in zip(idx, xs):
                a[i] = x
            return _launch.launch(
                launch.kernel,
                *a,
                out_shape=launch.out_shape,
                grid=launch.grid,
                num_warps=launch.num_warps,
                num_stages=launch.num_stages,
                **launch.constexprs,
            )[0]

        uargs = [
            concrete.get(names[i], jnp.zeros(launch.args[i].shape, launch.args[i].dtype))
            for i in idx
        ]
        usual_f = jax.jit(run_usual)
        outs = {n: jax.block_until_ready(f(*args)) for n, f in fns.items()}
        outs["usual"] = jax.block_until_ready(usual_f(*uargs))
        for n, o in outs.items():
            print(f"  err {n:16s} {rel(o, outs['ws']):.2e}")
        total = 6 * b * h * s * s * d / (2 if causal else 1)
        res = {}
        for _ in range(ROUNDS):
            for n, f in fns.items():
                res.setdefault(n, []).append(total / ba.timed(f, *args, iters=10, repeats=3) / 1e9)
            res.setdefault("usual", []).append(
                total / ba.timed(usual_f, *uargs, iters=10, repeats=3) / 1e9
            )
        print(f"== dQ {shape} causal={causal} TFLOP/s (median; rounds)", flush=True)
        for n, xs in res.items():
            print(f"  {n:16s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))
