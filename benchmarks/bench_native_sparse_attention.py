"""Native sparse attention: the XLA NSA against dense causal flash attention at the same shapes.

Forward and forward+backward milliseconds of ``ejkernel.native_sparse_attention`` (compressed,
selected and sliding-window branches, the selection computed) and of causal
``ejkernel.flash_attention`` on the same query/key/value, with the compiled temporary memory
of each forward+backward. NSA's work grows as S·(S/bs + T·bs + W) against flash attention's
S²/2, so it wins once S is well past T·bs.

CPU (default): float32, (1, S, 4 query heads, 1 KV head, D=64), S = 1k … 4k, bs=64, T=8, W=128.
GPU (``--gpu``): bfloat16, (1, S, 16 query heads, 1 KV head, D=128), S = 8k … 32k, bs=64,
T=16, W=512 (the paper's settings, one KV group); ``--heads 64 --kv-heads 4`` is issue 31's shape.

``--platform P`` runs NSA on platform P (``xla``, ``triton``: opt-in) instead of the default
call's.

Run: ``python benchmarks/bench_native_sparse_attention.py [--gpu] [--seqs S ...] [--platform P]``
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
from _common import fwd_bwd, mib, temp_bytes, timed

import ejkernel


def _nsa(q: Any, k: Any, v: Any, *, gates: list[Any], nsa: dict[str, Any]) -> Any:
    return ejkernel.native_sparse_attention(q, k, v, *gates, **nsa)


def run(seqs: list[int], *, hq: int, hkv: int, d: int, nsa: dict[str, Any], dtype: Any) -> None:
    print(f"(1, S, Hq={hq}, Hkv={hkv}, D={d}) {jnp.dtype(dtype).name}, NSA {nsa}")
    print(
        "| S | NSA fwd ms | flash fwd ms | NSA fwd+bwd ms | flash fwd+bwd ms | temp MiB NSA | temp MiB flash |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in seqs:
        ks = jax.random.split(jax.random.PRNGKey(0), 7)
        q = jax.random.normal(ks[0], (1, s, hq, d)).astype(dtype)
        k = jax.random.normal(ks[1], (1, s, hkv, d)).astype(dtype)
        v = jax.random.normal(ks[2], (1, s, hkv, d)).astype(dtype)
        gates = [
            jax.nn.sigmoid(jax.random.normal(key, (1, s, hq))).astype(dtype) for key in ks[3:6]
        ]
        do = jax.random.normal(ks[6], (1, s, hq, d)).astype(dtype)
        sparse = functools.partial(_nsa, gates=gates, nsa=nsa)
        dense = lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=True)

        cells = []
        for attn in (sparse, dense):
            cells.append(f"{timed(jax.jit(attn), q, k, v, iters=5, repeats=3):.1f}")
        for attn in (sparse, dense):
            cells.append(f"{timed(fwd_bwd(attn), q, k, v, do, iters=5, repeats=3):.1f}")
        cells += [mib(temp_bytes(fwd_bwd(attn), q, k, v, do)) for attn in (sparse, dense)]
        print(f"| {s} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--seqs", nargs="*", type=int, default=None)
    parser.add_argument("--platform", default=None, help="NSA's platform (default: the chosen)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (GPU default 16)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (GPU default 1)")
    args = parser.parse_args()
    chosen = {} if args.platform is None else {"platform": args.platform}
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    if args.gpu:
        nsa = {"block_size": 64, "block_counts": 16, "window_size": 512, **chosen}
        hq, hkv = args.heads or 16, args.kv_heads or 1
        run(args.seqs or [8192, 16384, 32768], hq=hq, hkv=hkv, d=128, nsa=nsa, dtype=jnp.bfloat16)
    else:
        nsa = {"block_size": 64, "block_counts": 8, "window_size": 128, **chosen}
        run(args.seqs or [1024, 2048, 4096], hq=4, hkv=1, d=64, nsa=nsa, dtype=jnp.float32)


if __name__ == "__main__":
    main()
