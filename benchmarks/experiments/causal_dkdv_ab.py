"""A/B on the GPU, one process, interleaved rounds (run from the repository root with ours
installed, as ``benchmarks/gpu_attention.sh`` does): the usual (not warp-specialized) kernels,
mostly under a causal mask, at D 64 where the specialized ones lose.

1. ``kernels``: each of the three kernels alone (forward, dK/dV, dQ) on the same inputs at
   several block configs, and the warp-specialized kernels; errors against the first row.
2. ``op``: forward+backward through the op: the tenth session's heuristic (64×64 blocks
   everywhere; its forward in grid order and grouped), the backward configs ``DKDV`` × ``DQ``,
   the heuristic, cuDNN and tokamax's Triton attention.

Arguments: the parts; the configs: ``wide``, ``more``, ``grouped`` (the forward's
``HEAD_GROUP`` too) or ``opcfg`` (the op's candidates); shapes by name (``d64c``, ``d128c``,
``d64``, ``d128``; all four by default). ``tiny``: a dry run on a CPU, in the interpreter.
Results: ``benchmarks/results/triton-*-h100-2026-11-23-s11.log``. Variants measured with
earlier versions of this script and not kept: all programs longest first (``…-causal-order-…``),
dK/dV programs doing key blocks ``i`` and ``last - i`` (``…-dkdv-paired-…``), one masked loop
over all blocks (``…-one-loop-…``).
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
SHAPES = [
    ((8, 2048, 16, 64), True),
    ((4, 4096, 16, 128), True),
    ((8, 2048, 16, 64), False),
    ((4, 4096, 16, 128), False),
]
FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
DKDV = [(64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (128, 128, 8, 2)]
DQ = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3)]
if "wide" in PARTS:  # 4-warp tiles with 128-wide matmuls, more stages
    FWD = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 4, 2), (64, 64, 4, 4)]
    DKDV = [(64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2)]
    DKDV += [(128, 64, 4, 1), (64, 64, 8, 2)]
    DQ = [(64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
if "more" in PARTS:  # more dK/dV and dQ configs at 4 warps
    FWD = [(64, 64, 4, 3)]
    DKDV = [(64, 64, 4, 2), (128, 64, 4, 1), (64, 64, 4, 1), (32, 64, 4, 3), (32, 64, 4, 1)]
    DKDV += [(128, 32, 4, 1), (64, 32, 4, 2), (256, 64, 4, 1), (32, 64, 4, 2), (64, 64, 4, 3)]
    DQ = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 4, 3)]
GROUPS = []
if "opcfg" in PARTS:  # the op's candidates: dK/dV and dQ configs (with the grouped forward)
    DKDV = [(64, 64, 4, 2), (32, 64, 4, 2), (128, 64, 4, 1), (64, 64, 4, 3)]
    DQ = [(64, 64, 4, 3), (64, 64, 4, 2)]
if "grouped" in PARTS:  # causal: longest blocks first within groups of heads (HEAD_GROUP)
    GROUPS = [4, 16, 128]
    FWD, DKDV, DQ = (
        [(64, 64, 4, 3)],
        [(64, 64, 4, 2), (128, 64, 4, 1), (32, 64, 4, 2)],
        [
            (64, 64, 4, 3),
        ],
    )
PICK = {"d64c": SHAPES[0], "d128c": SHAPES[1], "d64": SHAPES[2], "d128": SHAPES[3]}
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
    base = attrs.evolve(base, fwd_params=fa._FWD_D128, bwd_params=fa._BWD_D128, dq_params=None)
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
    """The recorded launches of ``cfg``: ``[forward, dK/dV, dQ]``."""
    with _codegen.recorded_launches() as rec:
        _, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=causal, cfg=cfg)
        fa._flash_attention_bwd(res, do, cfg=cfg, causal=causal)
    dq = next(r for r in rec if "dq" in r.kernel.fn.__name__)
    dkdv = next(r for r in rec if "dkdv" in r.kernel.fn.__name__)
    return [rec[0], dkdv, dq]


def runner(launch, concrete, head_group=0):
    names = launch.kernel.arg_names
    idx = [i for i, a in enumerate(launch.args) if getattr(a, "ndim", 0) > 0]
    arrs = [
        concrete.get(names[i], jnp.zeros(launch.args[i].shape, launch.args[i].dtype)) for i in idx
    ]
    cx = dict(launch.constexprs)
    if "HEAD_GROUP" in cx:
        cx["HEAD_GROUP"] = head_group

    def run(*xs):
        args = list(launch.args)
        for i, x in zip(idx, xs):
            args[i] = x
        return _launch.launch(
            launch.kernel,
            *args,
            out_shape=launch.out_shape,
            grid=launch.grid,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **cx,
        )[0]

    f = jax.jit(run)
    return lambda: f(*arrs)


if "kernels" in PARTS:
    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v, do = inputs(shape, 4, s + d)
        cfg = usual(q, k, v)
        out, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=causal, cfg=cfg)
        delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
        concrete = {"Q": q, "K": k, "V": v, "DO": do, "Lse": res["lse"], "Delta": delta, "Out": out}
        unit = b * h * s * s * d / (2 if causal else 1)
        ws = launched(attrs.evolve(cfg, warp_specialize=True), q, k, v, do, causal)
        for which, blocks, key, mult in (
            ("fwd", FWD, "fwd", 4),
            ("dkdv", DKDV, "bwd", 8),
            ("dq", DQ, "dq", 6),
        ):
            fns, outs = {}, {}
            for blk in blocks:
                rec = launched(usual(q, k, v, **{key: blk}), q, k, v, do, causal)
                launch = rec[("fwd", "dkdv", "dq").index(which)]
                name = f"{which} {blk[0]}x{blk[1]} w{blk[2]} s{blk[3]}"
                fns[name] = runner(launch, concrete)
                for g in GROUPS if causal and which == "fwd" else ():
                    fns[name + f" group {g}"] = runner(launch, concrete, head_group=g)
            launch = ws[("fwd", "dkdv", "dq").index(which)]
            fns[f"{which} {launch.kernel.fn.__name__}"] = runner(launch, concrete)
            for n, f in list(fns.items()):
                try:
                    outs[n] = jax.block_until_ready(f())
                except Exception as e:
                    print("FAIL", n, type(e).__name__, str(e)[:300], flush=True)
                    fns.pop(n)
            ref = next(iter(outs.values()))
            for n, o in outs.items():
                print(f"  err {n:36s} {rel(o, ref):.2e}", flush=True)
            race(f"{which} {shape} causal={causal}", fns, (), mult * unit)

if "op" in PARTS:
    impls = ba.implementations()
    real_launch = _launch.launch

    def grid_order_launch(kernel, *args, **kw):
        if kw.get("HEAD_GROUP"):
            kw["HEAD_GROUP"] = 0
        return real_launch(kernel, *args, **kw)

    for shape, causal in SHAPES:
        b, s, h, d = shape
        q, k, v = inputs(shape, 3, s + d)

        def grad_of(attn, grid_order=False):
            def loss(q, k, v):
                return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            if not grid_order:
                return g

            def traced_in_grid_order(*xs):  # the patch is read while tracing (first call)
                _launch.launch = grid_order_launch
                try:
                    return g(*xs)
                finally:
                    _launch.launch = real_launch

            return traced_in_grid_order

        def tri(cfg):
            return lambda q, k, v: ejkernel.flash_attention(
                q, k, v, causal=causal, platform="triton", cfg=cfg
            )

        fns = {
            "session-10 heuristic, grid order": grad_of(tri(usual(q, k, v)), grid_order=True),
            "session-10 heuristic": grad_of(tri(usual(q, k, v))),
        }
        for bwd in DKDV:
            for dq in DQ:
                tag = f"bwd {bwd[0]}x{bwd[1]}w{bwd[2]}s{bwd[3]} dq {dq[0]}x{dq[1]}w{dq[2]}s{dq[3]}"
                fns[tag] = grad_of(tri(usual(q, k, v, bwd=bwd, dq=dq)))
        fns["heuristic"] = grad_of(tri(None))
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
