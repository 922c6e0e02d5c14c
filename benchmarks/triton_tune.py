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
from ejkernel.ops import BwdParams, FwdParams
from ejkernel_triton.ops.flash_attention import FlashAttentionConfig


def sweep(quick: bool, dims: list[int], causals: list[bool]) -> None:
    shapes = [shape for shape in ((4, 4096, 16, 128), (8, 2048, 16, 64)) if shape[3] in dims]
    for (b, s, h, d), causal in itertools.product(shapes, causals):
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
            for bq, bk, w, st in FWD_CANDIDATES
        ]
        best_fwd = _best(
            "fwd",
            [FlashAttentionConfig(fwd_params=fp) for fp in fwds],
            lambda cfg: jax.jit(
                lambda q, k, v: ejkernel.flash_attention(
                    q, k, v, causal=causal, platform="triton", cfg=cfg
                )
            ),
            (q, k, v),
            lambda t: f"{tf(t):5.0f} TFLOP/s ({t_c / t:.2f}x cuDNN)",
            quick,
        ).fwd_params

        def fwd_bwd(cfg):
            def att(q, k, v):
                return ejkernel.flash_attention(q, k, v, causal=causal, platform="triton", cfg=cfg)

            return jax.jit(lambda q, k, v, do: jax.vjp(att, q, k, v)[1](do))

        def report(t):
            return f"fwd+bwd {tf(t, 3.5):5.0f} TFLOP/s ({t_cfb / t:.2f}x cuDNN)"

        dq0 = FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=8, num_stages=2)
        best_bwd = _best(
            "dkdv",
            [
                FlashAttentionConfig(
                    fwd_params=best_fwd,
                    bwd_params=BwdParams(
                        q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=st
                    ),
                    dq_params=dq0,
                )
                for bq, bk, w, st in DKDV_CANDIDATES
            ],
            fwd_bwd,
            (q, k, v, do),
            report,
            quick,
        ).bwd_params
        _best(
            "dq",
            [
                FlashAttentionConfig(
                    fwd_params=best_fwd,
                    bwd_params=best_bwd,
                    dq_params=FwdParams(
                        q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=st
                    ),
                )
                for bq, bk, w, st in DQ_CANDIDATES
            ],
            fwd_bwd,
            (q, k, v, do),
            report,
            quick,
        )


#: (rows per program or step, keys, warps, stages): the configs that compile for sm_90 without
#: register spills or with few (``python -m ejkernel_triton._codegen`` counts them), and fit
#: the H100's shared memory at D 128.
FWD_CANDIDATES = [
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (64, 128, 8, 2),
    (64, 128, 8, 3),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
]
#: dK/dV: (queries per step, keys per program, warps, stages)
DKDV_CANDIDATES = [
    (16, 128, 8, 1),
    (16, 128, 8, 2),
    (16, 128, 8, 3),
    (32, 128, 8, 2),
    (32, 64, 8, 2),
    (64, 64, 8, 2),
    (64, 64, 4, 2),
    (64, 128, 8, 2),
    (64, 32, 8, 1),
]
#: dQ: (queries per program, keys per step, warps, stages)
DQ_CANDIDATES = [
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 32, 8, 2),
    (128, 32, 8, 3),
    (32, 128, 8, 2),
    (64, 32, 8, 2),
    (16, 128, 8, 2),
    (64, 64, 4, 2),
]


def _best(name, configs, build, args, describe, quick):
    """Time each config (``build(cfg)`` is a jitted function of ``args``); print the top four."""
    results = []
    for cfg in configs[:4] if quick else configs:
        try:
            results.append((timed(build(cfg), *args, iters=5, repeats=3), cfg))
        except Exception as err:
            print(f"  {name} {cfg}: {type(err).__name__}: {str(err)[:120]}")
    results.sort(key=lambda r: r[0])
    for t, cfg in results[:4]:
        part = {"fwd": cfg.fwd_params, "dkdv": cfg.bwd_params, "dq": cfg.dq_params}[name]
        print(f"  {name:4s} {describe(t)} {part}", flush=True)
    return results[0][1]


def main() -> None:
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dims", type=int, nargs="*", default=[128, 64], help="head dims")
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    args = parser.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    sweep(args.quick, args.dims, causals)


if __name__ == "__main__":
    main()
