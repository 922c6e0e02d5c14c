"""Pallas Mosaic-GPU flash attention on an H100, side by side with cuDNN (and tokamax if present).

Run on the GPU machine from wheels installed to a folder on PYTHONPATH::

    PYTHONPATH=/tmp/site python benchmarks/bench_pallas_gpu.py

Cases (bf16): B4 S4096 H16 D128 and B8 S2048 H16 D64, causal and not; forward and
forward+backward. TFLOP/s use BENCHMARKS.md's convention (forward 4·B·H·Sq·Sk·D, halved for
causal; forward+backward 3.5× that). Each timing is the median of several repetitions of many
iterations after warm-up. Correctness is checked in the same run against the float32 reference
(on the first head, so the dense reference fits), forward and gradients. Every case runs in
its own try/except: a failure prints its cause and the table says FAIL; the script goes on.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")

import jax
import jax.numpy as jnp
from _common import fwd_bwd, timed

CASES = [  # (B, S, H, D, causal)
    (4, 4096, 16, 128, False),
    (4, 4096, 16, 128, True),
    (8, 2048, 16, 64, False),
    (8, 2048, 16, 64, True),
]


def _time_both(
    name: str, attn: Callable[..., Any], qkvdo: tuple[Any, ...], flops: float, iters: int, reps: int
) -> tuple[float, float]:
    """Seconds per forward and per forward+backward call, printed as TFLOP/s."""
    q, k, v, do = qkvdo
    fwd_t = timed(jax.jit(attn), q, k, v, iters=iters, repeats=reps, warm_calls=3) / 1e3
    both_t = timed(fwd_bwd(attn), q, k, v, do, iters=iters, repeats=reps, warm_calls=3) / 1e3
    print(
        f"  {name:15s} fwd {flops / fwd_t / 1e12:6.1f} TFLOP/s   "
        f"fwd+bwd {3.5 * flops / both_t / 1e12:6.1f} TFLOP/s",
        flush=True,
    )
    return fwd_t, both_t


def _rel(a: Any, b: Any) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _implementations(causal: bool) -> dict[str, Callable[..., Any]]:
    import ejkernel

    impls: dict[str, Callable[..., Any]] = {
        "pallas": lambda q, k, v: ejkernel.flash_attention(
            q, k, v, causal=causal, platform="pallas"
        ),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        ),
    }
    try:
        import tokamax

        impls["tokamax-mosaic"] = lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="mosaic"
        )
    except Exception as err:  # optional anchor
        print(f"(tokamax not timed: {type(err).__name__}: {err})")
    return impls


def _check(
    name: str, attn: Callable[..., Any], q: Any, k: Any, v: Any, do: Any, causal: bool
) -> str:
    """Max relative error (out, dq, dk, dv) of head 0 vs the float32 reference."""
    from ejkernel.specs.flash_attention import flash_attention_reference

    out, grads = fwd_bwd(attn)(q, k, v, do)
    h0 = lambda x: x[:, :, :1].astype(jnp.float32)
    ref = lambda q, k, v: flash_attention_reference(q, k, v, causal=causal)
    ref_out, vjp = jax.vjp(ref, h0(q), h0(k), h0(v))
    ref_grads = vjp(h0(do))
    errs = [_rel(h0(out), ref_out)] + [_rel(h0(g), r) for g, r in zip(grads, ref_grads)]
    worst = max(errs)
    flag = "" if worst < 2e-2 else "  <-- WRONG"
    print(f"  {name:15s} rel err out/dq/dk/dv: " + " ".join(f"{e:.1e}" for e in errs) + flag)
    return f"{worst:.1e}"


def run_case(b: int, s: int, h: int, d: int, causal: bool, iters: int, reps: int) -> list[str]:
    print(f"\n== B{b} S{s} H{h} D{d} {'causal' if causal else 'full'} ==", flush=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (
        jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys
    )
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    row = [f"B{b} S{s} H{h} D{d} {'causal' if causal else 'full'}"]
    results: dict[str, tuple[float | None, float | None, str]] = {}
    for name, attn in _implementations(causal).items():
        fwd_t = both_t = None
        err = "FAIL"
        try:
            err = _check(name, attn, q, k, v, do, causal)
            fwd_t, both_t = _time_both(name, attn, (q, k, v, do), flops, iters, reps)
        except Exception as e:
            print(f"  {name:15s} FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            traceback.print_exc(limit=8)
        results[name] = (fwd_t, both_t, err)
    base = results.get("cudnn", (None, None, ""))
    for name in ("pallas", "cudnn", "tokamax-mosaic"):
        fwd_t, both_t, err = results.get(name, (None, None, "-"))
        cell = lambda t, mult: "FAIL" if t is None else f"{mult * flops / t / 1e12:.0f}"
        row += [cell(fwd_t, 1), cell(both_t, 3.5)]
        if name == "pallas":
            ratio = lambda t, t0: "-" if t is None or t0 is None else f"{t0 / t:.2f}x"
            row += [ratio(fwd_t, base[0]), ratio(both_t, base[1]), err]
    return row


def sweep_case(b: int, s: int, h: int, d: int, causal: bool, iters: int, reps: int) -> None:
    """Forward and forward+backward TFLOP/s of each (bq, bk, stages) of the tuning list, with
    cuDNN timed in the same process."""
    import ejkernel
    from ejkernel.ops import BwdParams, FwdParams
    from ejkernel_pallas.gpu.flash_attention import TUNING, FlashAttentionConfig

    print(f"\n== sweep B{b} S{s} H{h} D{d} {'causal' if causal else 'full'} ==", flush=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (
        jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys
    )
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    cudnn = _implementations(causal)["cudnn"]
    for triple in (None, *TUNING):
        if triple is None:
            name, attn = "cudnn", cudnn
        else:
            bq, bk, stages = triple
            cfg = FlashAttentionConfig(
                fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_stages=stages),
                bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_stages=stages),
            )
            name = f"{bq}x{bk} st{stages}"
            attn = functools.partial(
                ejkernel.flash_attention, causal=causal, platform="pallas", cfg=cfg
            )
        try:
            _time_both(name, attn, (q, k, v, do), flops, iters, reps)
        except Exception as e:
            print(f"  {name:15s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="first case only")
    parser.add_argument(
        "--sweep", action="store_true", help="time every tuning config (D 128 cases) and stop"
    )
    args = parser.parse_args()
    import ejkernel

    if args.sweep:
        for case in CASES[:2]:
            sweep_case(*case, iters=args.iters, reps=args.reps)
        return

    print(f"jax {jax.__version__}, devices {jax.devices()}, python {sys.version.split()[0]}")
    print(f"ejkernel from {os.path.dirname(ejkernel.__file__)}")
    header = [
        "case",
        "pallas fwd",
        "pallas f+b",
        "vs cuDNN fwd",
        "vs cuDNN f+b",
        "pallas err",
        "cuDNN fwd",
        "cuDNN f+b",
        "tokamax fwd",
        "tokamax f+b",
    ]
    rows = []
    for case in CASES[:1] if args.quick else CASES:
        try:
            rows.append(run_case(*case, iters=args.iters, reps=args.reps))
        except Exception as e:  # a case must never stop the others
            print(f"case {case} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(limit=8)
            rows.append([str(case)] + ["FAIL"] * (len(header) - 1))
    print("\nTFLOP/s (bf16; forward+backward = 3.5x forward FLOPs); ratios = cuDNN time / ours")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        row = row + ["-"] * (len(header) - len(row))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
