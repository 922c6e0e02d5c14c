"""gla on the GPU: the Triton kernels against the XLA path and flash-linear-attention.

Times ``ejkernel.gla`` with ``platform="triton"`` and ``platform="xla"`` (heuristic configs,
jitted), forward and forward+backward (``jax.vjp`` with a fixed cotangent, gradients of query,
key, value and g), and flash-linear-attention's ``chunk_gla`` on torch when ``fla`` imports
(its refusal, if it raises, is printed instead of a time). Each ejkernel row also shows its
relative error against the XLA path in float32 (output, and the largest of the gradients'), so
a fast wrong kernel never counts.

Default shape: B 2, T 8192, H 16, K = V = 128, bfloat16, gates ``log_sigmoid(x) / 16`` (GLA's).
Configs come from the heuristics (``EJKERNEL_AUTOTUNE_POLICY=heuristics`` unless set). Timing:
median of ``--repeats`` batches of ``--iters`` calls after a warm-up
(:func:`benchmarks._common.timed`; torch the same with ``torch.cuda.synchronize``).

Run: ``python benchmarks/bench_gla.py [--shape B,T,H,K,V ...] [--iters 10] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from _common import timed

import ejkernel

os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")


def inputs(b: int, t: int, h: int, dk: int, dv: int) -> dict[str, jax.Array]:
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    bf16 = jnp.bfloat16
    return {
        "query": jax.random.normal(ks[0], (b, t, h, dk), bf16),
        "key": jax.random.normal(ks[1], (b, t, h, dk), bf16),
        "value": jax.random.normal(ks[2], (b, t, h, dv), bf16),
        "g": jax.nn.log_sigmoid(jax.random.normal(ks[3], (b, t, h, dk))) / 16,
        "d_out": jax.random.normal(ks[4], (b, t, h, dv), bf16),
    }


def ejkernel_fns(platform: str) -> tuple[Any, Any]:
    def fwd(q: Any, k: Any, v: Any, g: Any) -> Any:
        return ejkernel.gla(q, k, v, g, platform=platform)

    def fwd_bwd(q: Any, k: Any, v: Any, g: Any, d_out: Any) -> Any:
        out, vjp = jax.vjp(fwd, q, k, v, g)
        return out, vjp(d_out.astype(out.dtype))

    return jax.jit(fwd), jax.jit(fwd_bwd)


def rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def fla_times(x: dict[str, jax.Array], iters: int, repeats: int) -> tuple[str, str]:
    """flash-linear-attention's ``chunk_gla`` forward and forward+backward (ms), or why not."""
    try:
        import numpy as np
        import torch
        from fla.ops.gla import chunk_gla
    except Exception as err:  # not installed on this machine
        return (f"n/a ({type(err).__name__})",) * 2

    def tensor(a: Any, grad: bool = False) -> Any:
        t = torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda()
        return t.to(torch.bfloat16 if a.dtype == jnp.bfloat16 else torch.float32).requires_grad_(
            grad
        )

    q, k, v = (tensor(x[n], True) for n in ("query", "key", "value"))
    g, d_out = tensor(x["g"], True), tensor(x["d_out"])

    def fwd() -> Any:
        with torch.no_grad():
            return chunk_gla(q, k, v, g)[0]

    def fwd_bwd() -> Any:
        out = chunk_gla(q, k, v, g)[0]
        out.backward(d_out)
        return out

    def median_ms(fn: Any) -> str:
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as err:  # e.g. fla refusing a gated backward on this Triton
            return f"raises {type(err).__name__}: {str(err)[:80]}"
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) * 1e3 / iters)
        return f"{statistics.median(runs):.3f}"

    return median_ms(fwd), median_ms(fwd_bwd)


def bench(shape: tuple[int, ...], iters: int, repeats: int) -> None:
    x = inputs(*shape)
    args = (x["query"], x["key"], x["value"], x["g"])
    up = tuple(a.astype(jnp.float32) for a in args)
    with jax.default_matmul_precision("highest"):
        _, ref_bwd = ejkernel_fns("xla")
        want, want_grads = ref_bwd(*up, x["d_out"].astype(jnp.float32))
    print(f"\n### gla B,T,H,K,V = {shape} bf16 ({jax.devices()[0].device_kind})")
    print("| contender | fwd ms | fwd+bwd ms | rel err out | max rel err grads |")
    print("|---|---|---|---|---|")
    for platform in ("triton", "xla"):
        fwd, fwd_bwd = ejkernel_fns(platform)
        t_f = timed(fwd, *args, iters=iters, repeats=repeats, warm_s=1.0)
        t_fb = timed(fwd_bwd, *args, x["d_out"], iters=iters, repeats=repeats)
        out, grads = fwd_bwd(*args, x["d_out"])
        err = max(rel(a, b) for a, b in zip(grads, want_grads, strict=True))
        print(
            f"| ejkernel {platform} | {t_f:.3f} | {t_fb:.3f} | {rel(out, want):.1e} | {err:.1e} |"
        )
    f, fb = fla_times(x, iters, repeats)
    print(f"| fla chunk_gla | {f} | {fb} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="B,T,H,K,V (repeatable)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    shapes = [tuple(int(n) for n in s.split(",")) for s in a.shape or ["2,8192,16,128,128"]]
    for shape in shapes:
        bench(shape, a.iters, a.repeats)


if __name__ == "__main__":
    main()
