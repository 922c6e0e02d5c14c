# ruff: noqa: B023 (closures over the loop are called inside the same iteration)
"""Triton flash attention on the GPU: a config sweep beside cuDNN, for choosing the heuristic.

A development tool (the harness, ``bench_attention.py``, is what RESULTS.md quotes; correctness
is ``tests/triton/test_flash_attention_gpu.py``). Prints, per shape and pass, the best configs.

Run (on the GPU): ``python benchmarks/triton_tune.py [--quick]``
"""

from __future__ import annotations

import argparse
import itertools
import os

import jax
import jax.numpy as jnp
from bench_attention import timed

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel_triton.ops.flash_attention import FlashAttentionConfig


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
    args = parser.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    sweep(args.quick)


if __name__ == "__main__":
    main()
