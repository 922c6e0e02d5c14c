"""A/B on the GPU, one process, interleaved rounds (run from the repository root with ours
installed, as ``benchmarks/gpu_attention.sh`` does): the causal program order of the backward
kernels (``_DQ_HEAD_GROUP``, ``_DKDV_HEAD_GROUP``; 0: grid order) against the longest
programs first in head groups of 8, and the Gluon dQ kernel against the warp-specialized one.

1. ``alone``: each dQ and dK/dV kernel alone, each order; errors against grid order;
2. ``op``: forward+backward through the op for each variant, beside cuDNN and tokamax's
   Triton attention (where installed).

Every timing (``bench_attention.timed``) first runs its function for 0.3 s, so that each is
measured at the GPU's steady clock under its own load (a function timed right after a lighter
one, or after an idle GPU, runs up to 8 % faster for a few tens of milliseconds); the order
of the variants rotates from round to round. Arguments: the parts (both by default)."""

# ruff: noqa: B023 (closures over loop variables run within their own iteration)

import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import bench_attention as ba
import jax
import jax.numpy as jnp
from bwd_profile import traced

from ejkernel_triton.ops import flash_attention as fa

PARTS = sys.argv[1:] or ["alone", "op"]
ROUNDS = 5
SHAPES = [(4, 4096, 16, 128), (2, 8192, 16, 128), (8, 2048, 16, 128)]


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def race(title, fns, args, flops):
    times: dict[str, list[float]] = {}
    names = list(fns)
    for r in range(ROUNDS):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times.setdefault(n, []).append(
                flops[n] / ba.timed(fns[n], *args, iters=20, repeats=5) / 1e9
            )
    print(f"== {title} TFLOP/s (median of {ROUNDS}; rounds in launch order)", flush=True)
    for n in names:
        xs = times[n]
        print(f"  {n:30s} {statistics.median(xs):7.1f}  " + " ".join(f"{x:.0f}" for x in xs))


for shape in SHAPES:
    b, s, h, d = shape
    ks = jax.random.split(jax.random.PRNGKey(s), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks)
    total = ba.flops(*shape, True)
    if "alone" in PARTS:
        cfg = fa._default_config(q, k, v, True)
        out, res = fa._flash_attention_fwd(query=q, key=k, value=v, causal=True, cfg=cfg)
        delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
        st = fa._Statics.of(q, k, v, None, True, None, None, cfg)
        args = (q, k, v, do, res["lse"], delta)
        fns = {}
        for kind, g in (("ws", 0), ("ws", 8), ("gluon", 0), ("gluon", 8)):
            fns[f"dq {kind} group {g}"] = traced(
                lambda *a: fa._dq_gluon(st, *a), (kind, g, 0), *args
            )
        for g in (0, 8):
            fns[f"dkdv gluon group {g}"] = traced(
                lambda *a: fa._dkdv_gluon(st, *a), ("ws", 0, g), *args
            )
        want = {"dq": fns["dq ws group 0"](*args), "dkdv": fns["dkdv gluon group 0"](*args)}
        for n, f in fns.items():
            got = f(*args)
            if n.startswith("dq"):
                print(f"{shape} {n} vs ws grid order: dq {rel(got, want['dq']):.1e}")
            else:
                w = want["dkdv"]
                print(f"{shape} {n}: dk {rel(got[0], w[0]):.1e} dv {rel(got[1], w[1]):.1e}")
        # dQ: 3 of the backward's 7 S²D products (1.5× the forward's); dK/dV: 4 (2×)
        flops = {n: total * (1.5 if n.startswith("dq") else 2.0) for n in fns}
        race(f"{shape} causal, kernels alone", fns, args, flops)
    if "op" in PARTS:
        ours = ba.ours_vjp(causal=True)
        variants = {
            "ws dq, grid order": ("ws", 0, 0),
            "ws dq 8, dkdv 8": ("ws", 8, 8),
            "ws dq 8, dkdv 0": ("ws", 8, 0),
            "gluon dq 8, dkdv 8": ("gluon", 8, 8),
        }
        fns = {n: traced(ours, var, q, k, v, do) for n, var in variants.items()}
        impls = ba.implementations()
        for name in ("cuDNN", "tokamax triton"):
            if name in impls:
                attn = impls[name]
                fns[name] = jax.jit(
                    lambda q, k, v, do, attn=attn: jax.vjp(lambda *a: attn(*a, True), q, k, v)[1](
                        do
                    )
                )
        want = fns["ws dq, grid order"](q, k, v, do)
        for n in list(variants)[1:]:
            got = fns[n](q, k, v, do)
            errs = " ".join(f"{rel(x, y):.1e}" for x, y in zip(got, want))
            print(f"{shape} op {n} vs grid order: dq dk dv {errs}")
        race(f"{shape} causal fwd+bwd", fns, (q, k, v, do), dict.fromkeys(fns, 3.5 * total))
