"""Ring attention: the sequence split over every device, against flash attention on one device.

For a global (B, S, H, D) causal problem: forward and forward+backward milliseconds of
``ejkernel.ring_attention`` inside ``jax.shard_map`` with the sequence split over all N devices,
and of ``ejkernel.flash_attention`` on the whole sequence on one device, with the compiled
temporary memory of each (per device for the ring). Ideal scaling is 1/N of the time; causal
rings do less: device r has r + 1 shards to attend to, so the last device sets the pace
(load balancing by striping the sequence is left to the caller).

CPU: ``--host-devices N`` splits the host into N XLA devices (set before JAX starts); they share
the same cores, so times show the ring's overhead, not a speed-up. GPU: every visible GPU.

Run: ``python benchmarks/bench_ring_attention.py [--host-devices 4] [--gpu] [--shapes B,S,H,D ...]``
"""

from __future__ import annotations

import argparse
import os

from _common import fwd_bwd, mib, temp_bytes, timed


def run(shapes: list[tuple[int, int, int, int]], dtype_name: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ejkernel

    n = jax.device_count()
    dtype = jnp.dtype(dtype_name)
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P(None, "sp"))
    print(f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind}, {dtype.name}, causal")
    print(
        f"| B, S, H, D | ring x{n} fwd ms | flash x1 fwd ms | ring x{n} fwd+bwd ms "
        "| flash x1 fwd+bwd ms | temp MiB ring (per device) | temp MiB flash |"
    )
    print("|---|---|---|---|---|---|---|")
    for b, s, h, d in shapes:
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, do = (jax.random.normal(key, (b, s, h, d)).astype(dtype) for key in ks)
        ring = jax.shard_map(
            lambda q, k, v: ejkernel.ring_attention(q, k, v, axis_name="sp", causal=True),
            mesh=mesh,
            in_specs=P(None, "sp"),
            out_specs=P(None, "sp"),
        )
        flash = lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=True)

        split = [jax.device_put(x, rows) for x in (q, k, v, do)]
        one = [jax.device_put(x, jax.devices()[0]) for x in (q, k, v, do)]
        cells = [
            f"{timed(jax.jit(ring), *split[:3], iters=5, repeats=3):.2f}",
            f"{timed(jax.jit(flash), *one[:3], iters=5, repeats=3):.2f}",
            f"{timed(fwd_bwd(ring), *split, iters=5, repeats=3):.2f}",
            f"{timed(fwd_bwd(flash), *one, iters=5, repeats=3):.2f}",
            mib(temp_bytes(fwd_bwd(ring), *split)),
            mib(temp_bytes(fwd_bwd(flash), *one)),
        ]
        print(f"| {b}, {s}, {h}, {d} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host-devices", type=int, default=None, help="CPU: split the host")
    parser.add_argument("--gpu", action="store_true", help="bf16 shapes for GPUs")
    parser.add_argument("--shapes", nargs="*", default=None, help="B,S,H,D (global)")
    args = parser.parse_args()
    if args.host_devices:
        flag = f"--xla_force_host_platform_device_count={args.host_devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    elif args.gpu:
        shapes = [(1, 32768, 16, 128), (1, 65536, 16, 128), (1, 131072, 8, 128)]
    else:
        shapes = [(1, 2048, 4, 64), (1, 8192, 4, 64)]
    run(shapes, "bfloat16" if args.gpu else "float32")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
