"""A/B on the GPU, one process, interleaved rounds (run from the repository root with ours
installed, as ``benchmarks/gpu_attention.sh`` does): the usual (not warp-specialized) kernels
under a causal mask.

1. ``kernels``: each of the three kernels alone (forward, dK/dV, dQ) on the same inputs at
   several block configs; the dK/dV kernel with its key blocks paired (``PAIRED``: program ``i``
   does blocks ``i`` and ``last - i``) and one per program; errors against the first row.
2. ``op``: forward+backward through the op at the backward configs of the config space, paired
   and not, against cuDNN and tokamax's Triton attention.

Arguments: the parts, and shapes by name (``d64c``, ``d128c``, ``d64``; all three by default).
``tiny`` runs it on a CPU in the interpreter (a dry run). The first version of this script
(``causal_order_ab.py``, ``results/triton-causal-order-ab-h100-2026-11-23-s11.log``) launched
the programs longest first instead, through a constexpr that was not kept.
"""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
import attrs
import bench_attention as ba
import jax
import jax.numpy as jnp

import ejkernel
from ejkernel.modules import BwdParams, FwdParams
from ejkernel_triton import _codegen, _launch
from ejkernel_triton.ops import flash_attention as fa

ROUNDS = 3
PARTS = sys.argv[1:] or ["kernels", "op"]
SHAPES = [((8, 2048, 16, 64), True), ((4, 4096, 16, 128), True), ((8, 2048, 16, 64), False)]
FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
DKDV = [(64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (128, 128, 8, 2)]
DQ = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3)]
PICK = {"d64c": SHAPES[0], "d128c": SHAPES[1], "d64": SHAPES[2]}
if any(p in PICK for p in PARTS):  # shapes by name among the arguments
    SHAPES = [PICK[p] for p in PARTS if p in PICK]
if "tiny" in PARTS:
    SHAPES, ROUNDS = [((1, 256, 2, 64), True)], 1
    FWD, DKDV, DQ = FWD[:1], DKDV[:2], DQ[:1]


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
        print(f"  {name:36s} {statistics.median(xs):7.1f}  {rounds}", flush=True)


def inputs(shape, n, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), n)
    return [jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks]


def usual(q, k, v, fwd=None, bwd=None, dq=None):
    base = attrs.evolve(fa._default_config(q, k, v), warp_specialize=False)
    base = attrs.evolve(base, fwd_params=fa._FWD_D128, bwd_params=fa._BWD_D128)
    if fwd:
        base = attrs.evolve(base, fwd_params=FwdParams(**_params(fwd)))
    if bwd:
        base = attrs.evolve(base, bwd_params=BwdParams(**_params(bwd)))
    if dq:
        base = attrs.evolve(base, dq_params=FwdParams(**_params(dq)))
    return base


def _params(t):
    return dict(zip(("q_blocksize", "kv_blocksize", "num_warps", "num_stages"), t))


def launched(cfg, q, k, v, do, causal):
    """The three recorded launches (forward, dK/dV, dQ) of ``cfg``."""
    with _codegen.recorded_launches() as rec:
        _, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=causal, cfg=cfg)
        fa._flash_attention_bwd(res, do, cfg=cfg, causal=causal)
    return rec


def runner(launch, concrete, paired):
    names = launch.kernel.arg_names
    idx = [i for i, a in enumerate(launch.args) if getattr(a, "ndim", 0) > 0]
    arrs = [
        concrete.get(names[i], jnp.zeros(launch.args[i].shape, launch.args[i].dtype)) for i in idx
    ]
    cx, grid = dict(launch.constexprs), launch.grid
    if "PAIRED" in cx and cx["PAIRED"] != paired:
        blocks = -(-launch.args[1].shape[1] // cx["BLOCK_N"])
        cx["PAIRED"], grid = paired, (-(-blocks // 2) if paired else blocks, grid[1])

    def run(*xs):
        args = list(launch.args)
        for i, x in zip(idx, xs):
            args[i] = x
        return _launch.launch(
            launch.kernel,
            *args,
            out_shape=launch.out_shape,
            grid=grid,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **cx,
        )[0]

    f = jax.jit(run)
    return lambda: f(*arrs)


if "kernels" in PARTS:
    for shape, causal in SHAPES:
        if not causal:
            continue
        b, s, h, d = shape
        q, k, v, do = inputs(shape, 4, s + d)
        cfg = usual(q, k, v)
        out, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=causal, cfg=cfg)
        delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
        concrete = {"Q": q, "K": k, "V": v, "DO": do, "Lse": res["lse"], "Delta": delta}
        unit = b * h * s * s * d / 2
        for which, blocks, key, mult in (
            ("fwd", FWD, "fwd", 4),
            ("dkdv", DKDV, "bwd", 8),
            ("dq", DQ, "dq", 6),
        ):
            fns, outs = {}, {}
            for blk in blocks:
                rec = launched(usual(q, k, v, **{key: blk}), q, k, v, do, causal)
                launch = rec[("fwd", "dkdv", "dq").index(which)]
                for paired in (True, False) if which == "dkdv" else (False,):
                    name = f"{which} {blk[0]}x{blk[1]} w{blk[2]} s{blk[3]}"
                    name += " paired" if paired else ""
                    fns[name] = runner(launch, concrete, paired)
            for n, f in list(fns.items()):
                try:
                    outs[n] = jax.block_until_ready(f())
                except Exception as e:
                    print("FAIL", n, type(e).__name__, str(e)[:300], flush=True)
                    fns.pop(n)
            ref = next(iter(outs.values()))
            for n, o in outs.items():
                print(f"  err {n:36s} {rel(o, ref):.2e}", flush=True)
            race(f"{which} {shape} causal", fns, (), mult * unit)

if "op" in PARTS:
    impls = ba.implementations()
    real_launch = _launch.launch

    def unpaired_launch(kernel, *args, grid, **kw):
        if kw.get("PAIRED"):
            kw["PAIRED"], grid = False, (-(-args[1].shape[1] // kw["BLOCK_N"]), grid[1])
        return real_launch(kernel, *args, grid=grid, **kw)

    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v = inputs(shape, 3, s + d)

        def grad_of(attn, unpaired=False):
            def loss(q, k, v):
                return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            if not unpaired:
                return g

            def traced_unpaired(*xs):  # the patch is read while tracing (first call)
                _launch.launch = unpaired_launch
                try:
                    return g(*xs)
                finally:
                    _launch.launch = real_launch

            return traced_unpaired

        def tri(cfg):
            return lambda q, k, v: ejkernel.flash_attention(
                q, k, v, causal=causal, platform="triton", cfg=cfg
            )

        fns = {}
        for bwd in DKDV[:3]:
            for dq in DQ[:2]:
                cfg = usual(q, k, v, bwd=bwd, dq=dq)
                tag = f"bwd {bwd[0]}x{bwd[1]}w{bwd[2]} dq {dq[0]}x{dq[1]}w{dq[2]}"
                fns[f"{tag}"] = grad_of(tri(cfg))
                if causal and dq == DQ[0]:
                    fns[f"{tag} unpaired"] = grad_of(tri(cfg), unpaired=True)
        if d == 128:
            fns["heuristic (ws)"] = grad_of(tri(None))
        if "tiny" not in PARTS:
            fns["cuDNN"] = grad_of(lambda q, k, v: impls["cuDNN"](q, k, v, causal))
            fns["tokamax triton"] = grad_of(
                lambda q, k, v: impls["tokamax triton"](q, k, v, causal)
            )
        outs = {}
        for n, f in list(fns.items()):
            try:
                outs[n] = jax.block_until_ready(f(q, k, v))
            except Exception as e:
                print("FAIL", n, type(e).__name__, str(e)[:400], flush=True)
                fns.pop(n)
        ref = outs.get("cuDNN", next(iter(outs.values())))
        for n, o in outs.items():
            errs = " ".join(f"{rel(a, r):.2e}" for a, r in zip(o, ref))
            print(f"  err vs ref {n:36s} dq dk dv {errs}", flush=True)
        race(f"fwd+bwd {shape} causal={causal}", fns, (q, k, v), 3.5 * ba.flops(b, s, h, d, causal))
