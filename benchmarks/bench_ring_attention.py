"""Ring attention: the sequence split over every device, against flash attention on one device.

For a global (B, S, H, D) causal problem: forward and forward+backward milliseconds of
``ejkernel.ring_attention`` inside ``jax.shard_map`` with the sequence split over all N devices
(``--layout contiguous`` or ``zigzag``: the load-balanced causal layout), the useful TFLOP/s per
device (causal flops / N), the compiled temporary memory per device, and the split of one ring
step: the flash-attention kernel on one device's shards (S/N queries × S/N keys, unmasked: a full
step) against one hop of the K and V shards around the ring (``lax.ppermute``). With
``--ref-seq`` (default 32768 on GPUs) flash attention on one device at that length, the figure
issue 31 compares the per-device rate with. Contiguous causal rings are unbalanced: device r
attends to r + 1 shards, so the last device sets the pace; zigzag evens the work.

CPU: ``--host-devices N`` splits the host into N XLA devices (set before JAX starts); they share
the same cores, so times show the ring's overhead, not a speed-up. GPU: every visible GPU.

Run: ``python benchmarks/bench_ring_attention.py [--host-devices 4] [--gpu] [--shapes B,S,H,D ...]``
"""

from __future__ import annotations

import argparse
import os

from _common import fwd_bwd, mib, temp_bytes, timed


def flops(b: int, s: int, h: int, d: int) -> float:
    """Forward flops of causal attention: 4·B·H·S²·D, halved (forward+backward: 3.5×)."""
    return 4.0 * b * h * s * s * d / 2


def run(
    shapes: list[tuple[int, int, int, int]], dtype_name: str, layout: str, ref_seq: int | None
) -> None:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ejkernel
    from ejkernel.ops import flash_attention_lse_step, zigzag_layout

    n = jax.device_count()
    dtype = jnp.dtype(dtype_name)
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P(None, "sp"))
    dev0 = jax.devices()[0]
    print(f"jax {jax.__version__}, {n} x {dev0.device_kind}, {dtype.name}, causal, {layout}")
    print(
        f"| B, S, H, D | ring x{n} fwd ms | TFLOP/s per device | ring x{n} fwd+bwd ms "
        "| TFLOP/s per device | temp MiB per device (fwd+bwd) | one step's flash ms "
        "(S/n, full) | one hop ms (K and V) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b, s, h, d in shapes:
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, do = (jax.random.normal(key, (b, s, h, d)).astype(dtype) for key in ks)
        if layout == "zigzag":
            q, k, v, do = (zigzag_layout(x, n) for x in (q, k, v, do))
        ring = jax.shard_map(
            lambda q, k, v: ejkernel.ring_attention(
                q, k, v, axis_name="sp", causal=True, layout=layout
            ),
            mesh=mesh,
            in_specs=P(None, "sp"),
            out_specs=P(None, "sp"),
        )

        def hop(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
            perm = [(i, (i + 1) % n) for i in range(n)]
            return lax.ppermute(k, "sp", perm), lax.ppermute(v, "sp", perm)

        rotate = jax.shard_map(hop, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
        split = [jax.device_put(x, rows) for x in (q, k, v, do)]
        local = [jax.device_put(x[:, : s // n], dev0) for x in (q, k, v)]
        step = lambda q, k, v: ejkernel.flash_attention(q, k, v)
        chosen = flash_attention_lse_step(query=local[0], key=local[1], value=local[2], causal=True)
        print(f"ring steps on: {chosen.platform}", flush=True)
        t_fwd = timed(jax.jit(ring), *split[:3], iters=3, repeats=3, warm_s=0.3)
        t_both = timed(fwd_bwd(ring), *split, iters=3, repeats=3, warm_s=0.3)
        per_device = flops(b, s, h, d) / n / 1e9
        cells = [
            f"{t_fwd:.2f}",
            f"{per_device / t_fwd:.0f}",
            f"{t_both:.2f}",
            f"{3.5 * per_device / t_both:.0f}",
            mib(temp_bytes(fwd_bwd(ring), *split)),
            f"{timed(jax.jit(step), *local, iters=5, repeats=3):.2f}",
            f"{timed(jax.jit(rotate), *split[1:3], iters=5, repeats=3):.3f}",
        ]
        print(f"| {b}, {s}, {h}, {d} | " + " | ".join(cells) + " |", flush=True)
    if ref_seq:
        b, _, h, d = shapes[0]
        ks = jax.random.split(jax.random.PRNGKey(1), 4)
        one = [
            jax.device_put(jax.random.normal(key, (b, ref_seq, h, d)).astype(dtype), dev0)
            for key in ks
        ]
        flash = lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=True)
        t_fwd = timed(jax.jit(flash), *one[:3], iters=5, repeats=3, warm_s=0.3)
        t_both = timed(fwd_bwd(flash), *one, iters=5, repeats=3, warm_s=0.3)
        total = flops(b, ref_seq, h, d) / 1e9
        print(
            f"flash attention on one device, ({b}, {ref_seq}, {h}, {d}) causal: fwd {t_fwd:.2f} "
            f"ms ({total / t_fwd:.0f} TFLOP/s), fwd+bwd {t_both:.2f} ms "
            f"({3.5 * total / t_both:.0f} TFLOP/s)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host-devices", type=int, default=None, help="CPU: split the host")
    parser.add_argument("--gpu", action="store_true", help="bf16 shapes for GPUs")
    parser.add_argument("--shapes", nargs="*", default=None, help="B,S,H,D (global)")
    parser.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag"))
    parser.add_argument(
        "--ref-seq", type=int, default=None, help="flash attention on one device at this S too"
    )
    args = parser.parse_args()
    if args.host_devices:
        flag = f"--xla_force_host_platform_device_count={args.host_devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    elif args.gpu:
        shapes = [(1, 131072, 16, 128)]
    else:
        shapes = [(1, 2048, 4, 64), (1, 8192, 4, 64)]
    ref_seq = args.ref_seq or (32768 if args.gpu else None)
    run(shapes, "bfloat16" if args.gpu else "float32", args.layout, ref_seq)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
