"""Flash attention: ejkernel's platforms side by side with the anchors, in one run.

CPU (default on a CPU machine): XLA flash attention forward+backward against
``jax.nn.dot_product_attention(implementation="xla")`` at (1, S, 8, 64) f32, S = 1k … 8k, with
the compiled temporary memory of each (linear vs quadratic in S).

GPU (``--gpu``): bf16 shapes of BENCHMARKS.md, every installed ejkernel platform against cuDNN
and XLA attention, forward and forward+backward, TFLOP/s (4·B·H·Sq·Sk·D forward, halved for
causal; ×3.5 for forward+backward), with the relative error against a float32 reference (on
one head) so a fast wrong kernel never counts.

Run: ``python benchmarks/bench_flash_attention.py [--gpu] [--shapes B,S,H,D ...]``
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import fwd_bwd, mib, temp_bytes, timed

import ejkernel
from ejkernel.specs.flash_attention import flash_attention_reference


def inputs(b: int, s: int, h: int, d: int, dtype: Any) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(k, (b, s, h, d), jnp.float32).astype(dtype) for k in ks)


def cpu(seqs: list[int]) -> None:
    print(
        "| S | ejkernel xla fwd+bwd ms | jax.nn xla fwd+bwd ms | ratio | temp MiB ejkernel | temp MiB jax.nn |"
    )
    print("|---|---|---|---|---|---|")
    for s in seqs:
        q, k, v, do = inputs(1, s, 8, 64, jnp.float32)
        ours = lambda q, k, v: ejkernel.flash_attention(q, k, v, platform="xla")
        anchor = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
        t_ours = timed(fwd_bwd(ours), q, k, v, do, iters=3, repeats=3)
        t_anchor = timed(fwd_bwd(anchor), q, k, v, do, iters=3, repeats=3)
        m_ours = mib(temp_bytes(fwd_bwd(ours), q, k, v, do), 1)
        m_anchor = mib(temp_bytes(fwd_bwd(anchor), q, k, v, do), 1)
        print(
            f"| {s} | {t_ours:.1f} | {t_anchor:.1f} | {t_ours / t_anchor:.2f} | {m_ours} | {m_anchor} |"
        )


def gpu(shapes: list[tuple[int, int, int, int]], platforms: list[str]) -> None:
    print(
        "| B, S, H, D | causal | impl | fwd TFLOP/s | fwd+bwd TFLOP/s | rel err (1 head, f32 ref) |"
    )
    print("|---|---|---|---|---|---|")
    for b, s, h, d in shapes:
        q, k, v, do = inputs(b, s, h, d, jnp.bfloat16)
        for causal in (False, True):
            flop = 4 * b * h * s * s * d / (2 if causal else 1)
            impls: dict[str, Callable[..., jax.Array]] = {
                f"ejkernel {p}": functools.partial(
                    ejkernel.flash_attention, causal=causal, platform=p
                )
                for p in platforms
            }
            impls["cuDNN"] = functools.partial(
                jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"
            )
            impls["XLA"] = functools.partial(
                jax.nn.dot_product_attention, is_causal=causal, implementation="xla"
            )
            ref = flash_attention_reference(
                q[:, :, :1].astype(jnp.float32),
                k[:, :, :1].astype(jnp.float32),
                v[:, :, :1].astype(jnp.float32),
                causal=causal,
            )
            for name, attn in impls.items():
                try:
                    out = jax.jit(attn)(q, k, v)
                    err = float(
                        jnp.linalg.norm(out[:, :, :1].astype(jnp.float32) - ref)
                        / jnp.linalg.norm(ref)
                    )
                    t_f = timed(jax.jit(attn), q, k, v)
                    t_fb = timed(fwd_bwd(attn), q, k, v, do)
                    row = f"{flop / t_f / 1e9:.0f} | {3.5 * flop / t_fb / 1e9:.0f} | {err:.1e}"
                except Exception as e:  # out of memory, unsupported: reported, never fatal
                    row = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | "
                print(
                    f"| {b}, {s}, {h}, {d} | {'yes' if causal else 'no'} | {name} | {row} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--shapes", nargs="*", default=None, help="B,S,H,D (gpu)")
    parser.add_argument(
        "--seqs", nargs="*", type=int, default=[1024, 2048, 4096, 8192], help="S (cpu)"
    )
    parser.add_argument("--platforms", nargs="*", default=["xla"])
    args = parser.parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    if args.gpu:
        shapes = (
            [tuple(int(x) for x in s.split(",")) for s in args.shapes]
            if args.shapes
            else [(4, 4096, 16, 128), (8, 2048, 16, 64), (1, 16384, 16, 128)]
        )
        gpu(shapes, args.platforms)  # type: ignore[arg-type]
    else:
        cpu(args.seqs)


if __name__ == "__main__":
    main()
