"""Ring attention on N host devices, against flash attention's reference on the global arrays.

Run by ``test_ring_attention.py`` in a subprocess, because the device count must be set before
JAX starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=N python _ring_attention_devices.py N``.
Each case calls ``ejkernel.ring_attention`` inside ``jax.shard_map`` with the sequence split over
axis ``"sp"`` and compares its output and its gradients (``jax.vjp`` through the shard_map) with
``flash_attention_reference`` and its gradients on the unsplit arrays. Prints one line per case;
exits 1 on the first mismatch.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.specs.ring_attention import ring_attention_reference
from ejkernel.testing import assert_close, random_normal
from ejkernel_xla.ops.ring_attention import RingAttentionConfig

AXIS = "sp"
ROWS = P(None, AXIS)  # [B, S, ...] split along S
DIFFERENTIABLE = ("query", "key", "value", "bias", "softmax_aux")


def case_arrays(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dv: int) -> dict[str, Any]:
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(sq * 7 + sk), 3)
    return {
        "query": random_normal(kq, (b, sq, hq, d)),
        "key": random_normal(kk, (b, sk, hkv, d)),
        "value": random_normal(kv, (b, sk, hkv, dv)),
    }


def run_case(
    name: str,
    mesh: Any,
    arrays: dict[str, Any],
    specs: dict[str, Any],
    statics: dict[str, Any],
    *,
    check_vma: bool,
    cfg: RingAttentionConfig | None = None,
    also_reference: bool = False,
) -> None:
    """Compare ring attention's output and gradients with the global reference; exit on error."""
    names = tuple(arrays)
    diff = tuple(n for n in names if n in DIFFERENTIABLE)

    def sharded(fn: Any) -> Any:
        return jax.shard_map(
            lambda *xs: fn(**dict(zip(names, xs)), **statics),
            mesh=mesh,
            in_specs=tuple(specs.get(n, ROWS) for n in names),
            out_specs=ROWS,
            check_vma=check_vma,
        )

    ring = sharded(lambda **kw: ejkernel.ring_attention(**kw, axis_name=AXIS, cfg=cfg))

    def with_grads(fn: Any, arrs: dict[str, Any]) -> tuple[Any, Any]:
        fixed = {n: x for n, x in arrs.items() if n not in diff}

        def f(wrt: dict[str, Any]) -> Any:
            merged = {**wrt, **fixed}
            return fn(*(merged[n] for n in names))

        out, vjp = jax.vjp(f, {n: arrs[n] for n in diff})
        return out, vjp(random_normal(jax.random.PRNGKey(9), out.shape, out.dtype))[0]

    @jax.jit
    def both(arrs: dict[str, Any]) -> Any:
        ours = with_grads(ring, arrs)
        expected = with_grads(
            lambda *xs: flash_attention_reference(**dict(zip(names, xs)), **statics), arrs
        )
        oracle = sharded(lambda **kw: ring_attention_reference(**kw, axis_name=AXIS))
        return ours, expected, (oracle(*(arrs[n] for n in names)) if also_reference else None)

    start = time.perf_counter()
    (out, grads), (ref_out, ref_grads), oracle_out = both(arrays)
    try:
        assert_close(out, ref_out, name=f"{name}: out")
        for n in diff:
            assert_close(grads[n], ref_grads[n], name=f"{name}: d{n}")
        if oracle_out is not None:
            assert_close(oracle_out, ref_out, name=f"{name}: ring_attention_reference")
    except AssertionError as err:
        print(f"MISMATCH {name}\n{err}", flush=True)
        sys.exit(1)
    print(f"ok {name} ({time.perf_counter() - start:.1f}s)", flush=True)


def main(n: int) -> None:
    if jax.device_count() != n:
        print(f"expected {n} devices, JAX sees {jax.device_count()}: set XLA_FLAGS first")
        sys.exit(2)
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    small = RingAttentionConfig(
        fwd_params=FwdParams(q_blocksize=4, kv_blocksize=4),
        bwd_params=BwdParams(q_blocksize=4, kv_blocksize=3),
    )
    if n == 4:
        # Sq != Sk globally (24 vs 40): causal is bottom-right aligned across shards.
        arrays = case_arrays(b=2, sq=24, sk=40, hq=4, hkv=2, d=16, dv=8)
        q_seg = (jnp.arange(24) // 9).astype(jnp.int32)
        kv_seg = (jnp.arange(40) // 14).astype(jnp.int32)
        arrays.update(
            q_segment_ids=jnp.stack([q_seg, q_seg.at[20:].set(-1)]),
            kv_segment_ids=jnp.stack([kv_seg, kv_seg]),
            softmax_aux=random_normal(jax.random.PRNGKey(3), (4, 2)),
            dropout_seed=jnp.uint32(5),
        )
        run_case(
            "n4-causal-gqa-softcap-sinks-segments-dropout",
            mesh,
            arrays,
            {"softmax_aux": P(), "dropout_seed": P()},
            {"causal": True, "logits_soft_cap": 3.0, "dropout_prob": 0.2},
            check_vma=True,
            cfg=small,
            also_reference=True,
        )
        arrays = case_arrays(b=1, sq=36, sk=36, hq=2, hkv=1, d=8, dv=8)
        arrays.update(
            bias=random_normal(jax.random.PRNGKey(4), (1, 2, 1, 36)),
            attention_mask=jax.random.bernoulli(jax.random.PRNGKey(5), 0.8, (1, 1, 36, 36)),
            softmax_aux=random_normal(jax.random.PRNGKey(6), (2,)),
        )
        run_case(
            "n4-untracked-replicated-bias-mask-window-mqa",
            mesh,
            arrays,
            {"bias": P(), "attention_mask": P(None, None, AXIS, None), "softmax_aux": P()},
            {"sliding_window": (5, 2)},
            check_vma=False,
            cfg=small,
        )
    else:
        arrays = case_arrays(b=1, sq=8 * 5, sk=8 * 5, hq=4, hkv=4, d=8, dv=8)
        arrays["bias"] = random_normal(jax.random.PRNGKey(7), (1, 4, 40, 40))
        run_case(
            f"n{n}-causal-window-sharded-bias-scale",
            mesh,
            arrays,
            {"bias": P(None, None, AXIS, None)},
            {"causal": True, "sliding_window": (7, 0), "softmax_scale": 0.3},
            check_vma=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]))
