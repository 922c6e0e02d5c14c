# ruff: noqa: B023 (closures over the loop are called inside the same iteration)
"""Triton flash attention on the GPU: correctness at odd shapes, then a config sweep with cuDNN.

A development tool for choosing the heuristic (the harness, ``bench_attention.py``, is what
RESULTS.md quotes). Prints, per shape and pass, the best configs found and cuDNN's time.

Run (on the GPU): ``python benchmarks/triton_tune.py [--quick]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel_triton.ops.flash_attention import FlashAttentionConfig


def timed(fn: Any, *args: Any, iters: int = 10, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(runs)


def rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def correctness(quick: bool) -> None:
    cases = [
        dict(shape=(2, 37, 45, 4, 2, 80), kw={}),
        dict(shape=(2, 37, 45, 4, 2, 80), kw={"causal": True}),
        dict(shape=(1, 300, 300, 8, 1, 64), kw={"causal": True, "logits_soft_cap": 20.0}),
        dict(shape=(2, 129, 200, 4, 4, 96), kw={"sliding_window": (33, 7)}),
        dict(shape=(1, 256, 256, 4, 2, 128), kw={"bias": True, "softmax_aux": True}),
        dict(shape=(2, 130, 130, 4, 2, 256), kw={"causal": True}),
        dict(shape=(2, 100, 100, 4, 4, 32), kw={"segments": True}),
    ]
    for dtype in (jnp.bfloat16, jnp.float32)[: 1 if quick else 2]:
        for case in cases:
            b, sq, sk, hq, hkv, d = case["shape"]
            ks = jax.random.split(jax.random.PRNGKey(sq * d), 8)
            q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
            k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
            v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(dtype)
            kw = dict(case["kw"])
            if kw.pop("bias", False):
                kw["bias"] = jax.random.normal(ks[3], (1, hq, sq, sk), jnp.float32).astype(dtype)
            if kw.pop("softmax_aux", False):
                kw["softmax_aux"] = jax.random.normal(ks[4], (hq,), jnp.float32)
            if kw.pop("segments", False):
                seg_q = jnp.sort(jax.random.randint(ks[5], (b, sq), 0, 3), axis=-1)
                kw["q_segment_ids"], kw["kv_segment_ids"] = seg_q, seg_q
            arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
            statics = {n: x for n, x in kw.items() if n not in arrays}
            do = jax.random.normal(ks[6], (b, sq, hq, d), jnp.float32).astype(dtype)

            def run(fn: Any, *inputs: Any, **extra: Any) -> Any:
                def f(q, k, v, arrays):
                    return fn(q, k, v, **arrays, **statics, **extra)

                out, vjp = jax.vjp(f, *inputs)
                return out, vjp(do.astype(out.dtype))

            try:
                out, grads = jax.jit(
                    lambda *a: run(ejkernel.flash_attention, *a, platform="triton")
                )(q, k, v, arrays)
                up = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
                ref_out, ref_grads = jax.jit(lambda *a: run(flash_attention_reference, *a))(
                    *up((q, k, v, arrays))
                )
                errs = [rel(out, ref_out)] + [
                    rel(g, r)
                    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
                    if jnp.issubdtype(g.dtype, jnp.floating)
                ]
                ok = max(errs) < (2e-2 if dtype == jnp.bfloat16 else 1e-4)
                print(
                    f"check {jnp.dtype(dtype).name:8} {case['shape']} {case['kw']}: "
                    f"{'ok' if ok else 'FAIL'} max rel err {max(errs):.2e}",
                    flush=True,
                )
            except Exception as err:  # report and go on
                print(f"check {case['shape']} {case['kw']}: ERROR {type(err).__name__}: {err}")
                traceback.print_exc(limit=3)


def sweep(quick: bool) -> None:
    shapes = [(4, 4096, 16, 128), (8, 2048, 16, 64)]
    for (b, s, h, d), causal in itertools.product(shapes, (False, True)):
        ks = jax.random.split(jax.random.PRNGKey(1), 4)
        q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.bfloat16) for x in ks)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)

        def tf(ms: float, mult: float = 1.0) -> float:
            return flops * mult / ms / 1e9

        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"
            )
        )
        cudnn_fb = jax.jit(lambda q, k, v, do: jax.vjp(cudnn, q, k, v)[1](do))
        t_c, t_cfb = timed(cudnn, q, k, v), timed(cudnn_fb, q, k, v, do)
        print(
            f"\n== B{b} S{s} H{h} D{d} causal={causal}: cuDNN fwd {tf(t_c):.0f} TFLOP/s, "
            f"fwd+bwd {tf(t_cfb, 3.5):.0f}",
            flush=True,
        )
        fwds = [
            FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=st)
            for bq, bk, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
        ]
        if quick:
            fwds = [f for f in fwds if (f.q_blocksize, f.num_stages) in ((128, 3), (128, 4))]
        results = []
        for fp in fwds:
            cfg = FlashAttentionConfig(fwd_params=fp)
            f = jax.jit(
                lambda q, k, v, cfg=cfg: ejkernel.flash_attention(
                    q, k, v, causal=causal, platform="triton", cfg=cfg
                )
            )
            try:
                results.append((timed(f, q, k, v, iters=5, repeats=3), fp))
            except Exception as err:
                print(f"  fwd {fp}: {type(err).__name__}: {str(err)[:120]}")
        results.sort(key=lambda r: r[0])
        for t, fp in results[:4]:
            print(f"  fwd {tf(t):5.0f} TFLOP/s ({tf(t) / tf(t_c):.2f}x cuDNN) {fp}", flush=True)
        best_fwd = results[0][1]
        bwds = [
            BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=st)
            for (bq, bk), w, st in itertools.product(
                ((32, 64), (32, 128), (64, 64), (64, 128), (16, 128)), (4, 8), (1, 2, 3)
            )
        ]
        if quick:
            bwds = [b for b in bwds if b.num_stages == 2 and b.q_blocksize != 16]
        results = []
        for bp in bwds:
            cfg = FlashAttentionConfig(fwd_params=best_fwd, bwd_params=bp)

            def att(q, k, v, cfg=cfg):
                return ejkernel.flash_attention(q, k, v, causal=causal, platform="triton", cfg=cfg)

            f = jax.jit(lambda q, k, v, do, att=att: jax.vjp(att, q, k, v)[1](do))
            try:
                results.append((timed(f, q, k, v, do, iters=3, repeats=3), bp))
            except Exception as err:
                print(f"  bwd {bp}: {type(err).__name__}: {str(err)[:120]}")
        results.sort(key=lambda r: r[0])
        for t, bp in results[:4]:
            print(
                f"  fwd+bwd {tf(t, 3.5):5.0f} TFLOP/s ({tf(t, 3.5) / tf(t_cfb, 3.5):.2f}x cuDNN) "
                f"{bp}",
                flush=True,
            )


def main() -> None:
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    if not args.no_check:
        with jax.default_matmul_precision("highest"):
            correctness(args.quick)
    sweep(args.quick)


if __name__ == "__main__":
    main()
