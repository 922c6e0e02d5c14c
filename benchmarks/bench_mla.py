"""Multi-head latent attention: decode against its roofline, prefill forward and backward.

Decode (``--decode``, default on GPUs: B 64, one query over an 8k latent cache, 128 query
heads, R 512, Dr 64, Dn = Dv 128, bf16): milliseconds of each platform, the latent cache read
in GB/s and the attention flops in TFLOP/s, against the roofline of the same run: the lower
of the copy bandwidth on the cache's bytes (``B·Sk·(R + Dr)`` elements, measured by copying a
buffer of that size) and the bf16 matmul ceiling on ``B·Hq·Sk·(4R + 2Dr)`` flops (measured
on an 8192³ matmul; 256³ on a CPU). Prefill (``--prefill``: B 1, S 4096, 16 heads): forward and
forward+backward milliseconds per platform. ``--configs``: instead, every absorbed config of
the Triton config space on the decode shape.

Run: ``python benchmarks/bench_mla.py [--gpu] [--platforms triton xla] [--decode|--prefill|--configs]``
"""

from __future__ import annotations

import argparse

from _common import ceilings, timed


def inputs(b: int, sq: int, sk: int, hq: int, r: int, dn: int, dr: int, dv: int, dtype) -> dict:
    import jax

    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    proj = r**-0.5
    return {
        "query": jax.random.normal(ks[0], (b, sq, hq, dn + dr)).astype(dtype),
        "key_value": jax.random.normal(ks[1], (b, sk, r)).astype(dtype),
        "w_kc": (jax.random.normal(ks[2], (r, hq, dn)) * proj).astype(dtype),
        "w_vc": (jax.random.normal(ks[3], (r, hq, dv)) * proj).astype(dtype),
        "k_rope": jax.random.normal(ks[4], (b, sk, dr)).astype(dtype),
    }


def decode(platforms: list[str], shape: tuple[int, ...], matmul_n: int) -> None:
    import jax
    import jax.numpy as jnp

    import ejkernel

    b, sk, hq, r, dn, dr, dv = shape
    arrays = inputs(b, 1, sk, hq, r, dn, dr, dv, jnp.bfloat16)
    cache_bytes = b * sk * (r + dr) * 2
    flops = b * hq * sk * (4 * r + 2 * dr)
    bw, peak = ceilings(cache_bytes, matmul_n)
    roof_ms = max(cache_bytes / bw / 1e6, flops / peak / 1e9)
    print(
        f"decode B {b}, Sk {sk}, Hq {hq}, R {r}, Dr {dr}, Dn {dn}, Dv {dv}, bf16 on "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: copy {bw:.0f} GB/s, bf16 "
        f"matmul {peak:.0f} TFLOP/s, roofline {roof_ms:.3f} ms"
    )
    print("| platform | ms | cache GB/s | TFLOP/s | of roofline |")
    print("|---|---|---|---|---|")
    for platform in platforms:
        fn = jax.jit(lambda a, p=platform: ejkernel.multi_head_latent_attention(**a, platform=p))
        try:
            ms = timed(fn, arrays, iters=20, repeats=5, warm_s=0.3)
        except Exception as err:  # a platform that cannot run here is reported, not fatal
            print(f"| {platform} | failed: {type(err).__name__}: {str(err)[:120]} | | | |")
            continue
        print(
            f"| {platform} | {ms:.3f} | {cache_bytes / ms / 1e6:.0f} | {flops / ms / 1e9:.0f} "
            f"| {roof_ms / ms:.0%} |",
            flush=True,
        )


def decode_configs(shape: tuple[int, ...]) -> None:
    """Every absorbed config of the Triton config space on the decode shape, with its error
    against the heuristic's."""
    import types

    import jax
    import jax.numpy as jnp

    import ejkernel
    from ejkernel_triton.ops import multi_head_latent_attention as mla

    b, sk, hq, r, dn, dr, dv = shape
    arrays = inputs(b, 1, sk, hq, r, dn, dr, dv, jnp.bfloat16)
    flops = b * hq * sk * (4 * r + 2 * dr)
    space = mla.config_space(types.SimpleNamespace(kwargs=arrays))
    print(
        f"decode configs B {b}, Sk {sk}, Hq {hq}, R {r}, Dr {dr} ({jax.devices()[0].device_kind})"
    )
    print("| config | ms | TFLOP/s | rel err vs the first |")
    print("|---|---|---|---|")
    want = None
    for cfg in space:
        if cfg.form != "absorbed":
            continue
        fn = jax.jit(
            lambda a, c=cfg: ejkernel.multi_head_latent_attention(**a, platform="triton", cfg=c)
        )
        try:
            ms = timed(fn, arrays, iters=10, repeats=3, warm_s=0.2)
            out = fn(arrays).astype(jnp.float32)
        except Exception as err:  # a config that cannot run here is reported, not fatal
            print(f"| {cfg} | failed: {type(err).__name__}: {str(err)[:100]} | | |", flush=True)
            continue
        want = out if want is None else want
        err = float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))
        print(f"| {cfg} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err:.1e} |", flush=True)


def prefill(platforms: list[str], shape: tuple[int, ...]) -> None:
    import jax
    import jax.numpy as jnp

    import ejkernel

    b, s, hq, r, dn, dr, dv = shape
    arrays = inputs(b, s, s, hq, r, dn, dr, dv, jnp.bfloat16)
    names = tuple(arrays)
    print(f"prefill B {b}, S {s}, Hq {hq}, R {r}, Dr {dr}, Dn {dn}, Dv {dv}, causal, bf16")
    print("| platform | fwd ms | fwd+bwd ms |")
    print("|---|---|---|")
    for platform in platforms:

        def attn(*xs, p=platform):
            return ejkernel.multi_head_latent_attention(
                **dict(zip(names, xs, strict=True)), causal=True, platform=p
            )

        def both(xs, d_out, attn=attn):
            out, pull = jax.vjp(attn, *xs)
            return out, pull(d_out)

        xs = [arrays[n] for n in names]
        d_out = jnp.ones((b, s, hq, dv), jnp.bfloat16)
        try:
            t_fwd = timed(jax.jit(attn), *xs, iters=5, repeats=3, warm_s=0.3)
            t_both = timed(jax.jit(both), xs, d_out, iters=5, repeats=3, warm_s=0.3)
        except Exception as err:
            print(f"| {platform} | failed: {type(err).__name__}: {str(err)[:120]} | |")
            continue
        print(f"| {platform} | {t_fwd:.3f} | {t_both:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true", help="the issue's GPU shapes")
    parser.add_argument("--platforms", nargs="*", default=["triton", "xla"])
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--configs", action="store_true", help="every absorbed decode config")
    args = parser.parse_args()
    both = not (args.decode or args.prefill)
    if args.gpu:
        decode_shape, prefill_shape = (
            (64, 8192, 128, 512, 128, 64, 128),
            (1, 4096, 16, 512, 128, 64, 128),
        )
    else:
        decode_shape, prefill_shape = (1, 64, 16, 32, 16, 16, 16), (1, 32, 2, 32, 16, 16, 16)
    if args.configs:
        decode_configs(decode_shape)
        return
    if args.decode or both:
        decode(args.platforms, decode_shape, 8192 if args.gpu else 256)
    if args.prefill or both:
        prefill(args.platforms, prefill_shape)


if __name__ == "__main__":
    main()
