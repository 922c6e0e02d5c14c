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
call's. ``--configs`` times the Triton NSA at each selected-branch config (warps, stages);
``--anchor fla`` times flash-linear-attention's ``parallel_nsa`` (torch, in a process of its own,
jax left on the CPU) at the same shapes; its window branch needs the flash-attn package, so
``--window 0`` compares the compressed and selected branches alone.

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
        q, k, v, gates, do = _inputs(s, hq, hkv, d, dtype)
        sparse = functools.partial(_nsa, gates=gates, nsa=nsa)
        dense = lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=True)

        cells = []
        for attn in (sparse, dense):
            cells.append(f"{timed(jax.jit(attn), q, k, v, iters=5, repeats=3):.1f}")
        for attn in (sparse, dense):
            cells.append(f"{timed(fwd_bwd(attn), q, k, v, do, iters=5, repeats=3):.1f}")
        cells += [mib(temp_bytes(fwd_bwd(attn), q, k, v, do)) for attn in (sparse, dense)]
        print(f"| {s} | " + " | ".join(cells) + " |", flush=True)


CONFIGS = ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2))


def configs(seqs: list[int], *, hq: int, hkv: int, d: int, nsa: dict[str, Any]) -> None:
    """The Triton NSA's forward and forward+backward at each (warps, stages) of :data:`CONFIGS`."""
    from ejkernel_triton.ops.native_sparse_attention import NativeSparseAttentionConfig

    print(f"(1, S, Hq={hq}, Hkv={hkv}, D={d}) bfloat16, Triton NSA {nsa}")
    print("| S | warps | stages | fwd ms | fwd+bwd ms |")
    print("|---|---|---|---|---|")
    for s in seqs:
        q, k, v, gates, do = _inputs(s, hq, hkv, d, jnp.bfloat16)
        for warps, stages in CONFIGS:
            cfg = NativeSparseAttentionConfig(num_warps=warps, num_stages=stages)
            f = functools.partial(_nsa, gates=gates, nsa={**nsa, "platform": "triton", "cfg": cfg})
            fwd = timed(jax.jit(f), q, k, v, iters=5, repeats=3)
            both = timed(fwd_bwd(f), q, k, v, do, iters=5, repeats=3)
            print(f"| {s} | {warps} | {stages} | {fwd:.2f} | {both:.2f} |", flush=True)


def fla_anchor(seqs: list[int], *, hq: int, hkv: int, d: int, nsa: dict[str, Any]) -> None:
    """flash-linear-attention's ``parallel_nsa`` (its selection from its compressed branch)."""
    import os
    import tempfile

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="bench-fla-"))
    print(f"(1, S, Hq={hq}, Hkv={hkv}, D={d}) bfloat16, fla parallel_nsa {nsa}")
    print("| S | fla fwd ms | fla fwd+bwd ms |")
    print("|---|---|---|")
    for s in seqs:
        print(f"| {s} | " + " | ".join(_fla_times(s, hq, hkv, d, nsa)) + " |", flush=True)


def _fla_times(s: int, hq: int, hkv: int, d: int, nsa: dict[str, Any]) -> list[str]:
    import statistics
    import time

    import torch
    from fla.ops.nsa.parallel import parallel_nsa

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    q, k, v = (rand(1, s, h, d).requires_grad_(True) for h in (hq, hkv, hkv))
    gates = [torch.sigmoid(rand(1, s, hq)) for _ in range(3)]
    do = rand(1, s, hq, d)

    def call() -> Any:
        return parallel_nsa(
            q,
            k,
            v,
            *gates,
            block_counts=nsa["block_counts"],
            block_size=nsa["block_size"],
            window_size=nsa["window_size"],
        )

    def fwd() -> None:
        with torch.no_grad():
            call()

    def both() -> None:
        call().backward(do)

    cells = []
    for fn in (fwd, both):
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as err:  # fla refuses some shapes and Triton versions
            cells.append(f"raises {type(err).__name__}: {str(err)[:80]}")
            continue
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) * 1e3 / 5)
        cells.append(f"{statistics.median(runs):.2f}")
    return cells


def _inputs(s: int, hq: int, hkv: int, d: int, dtype: Any) -> tuple[Any, ...]:
    ks = jax.random.split(jax.random.PRNGKey(0), 7)
    q = jax.random.normal(ks[0], (1, s, hq, d)).astype(dtype)
    k = jax.random.normal(ks[1], (1, s, hkv, d)).astype(dtype)
    v = jax.random.normal(ks[2], (1, s, hkv, d)).astype(dtype)
    gates = [jax.nn.sigmoid(jax.random.normal(key, (1, s, hq))).astype(dtype) for key in ks[3:6]]
    do = jax.random.normal(ks[6], (1, s, hq, d)).astype(dtype)
    return q, k, v, gates, do


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--seqs", nargs="*", type=int, default=None)
    parser.add_argument("--platform", default=None, help="NSA's platform (default: the chosen)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (GPU default 16)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (GPU default 1)")
    parser.add_argument("--configs", action="store_true", help="the Triton NSA's configs (GPU)")
    parser.add_argument(
        "--window", type=int, default=512, help="GPU window (0: none; fla needs flash-attn for one)"
    )
    parser.add_argument("--anchor", choices=("fla",), help="time fla's parallel_nsa only (GPU)")
    args = parser.parse_args()
    chosen = {} if args.platform is None else {"platform": args.platform}
    gpu_shape = {"hq": args.heads or 16, "hkv": args.kv_heads or 1, "d": 128}
    gpu_seqs = args.seqs or [8192, 16384, 32768]
    nsa = {"block_size": 64, "block_counts": 16, "window_size": args.window}
    if args.anchor == "fla":
        fla_anchor(gpu_seqs, **gpu_shape, nsa=nsa)
        return
    print(f"jax {jax.__version__}, devices {jax.devices()}, ejkernel {ejkernel.__version__}")
    if args.configs:
        configs(gpu_seqs, **gpu_shape, nsa=nsa)
    elif args.gpu:
        run(gpu_seqs, **gpu_shape, nsa={**nsa, **chosen}, dtype=jnp.bfloat16)
    else:
        nsa = {"block_size": 64, "block_counts": 8, "window_size": 128, **chosen}
        run(args.seqs or [1024, 2048, 4096], hq=4, hkv=1, d=64, nsa=nsa, dtype=jnp.float32)


if __name__ == "__main__":
    main()
