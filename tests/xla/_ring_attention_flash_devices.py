"""Ring attention on flash-attention steps, and ``Executor(method="shard_map")``, on N devices.

Run by ``test_ring_attention_flash.py`` in a subprocess, because the device count must be set
before JAX starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=N python
_ring_attention_flash_devices.py N``. Each ring case calls ``ejkernel.ring_attention`` inside
``jax.shard_map`` (the zigzag cases on inputs put into the layout by ``zigzag_layout``, the
output put back by ``undo_zigzag_layout``) and compares output and gradients with
``flash_attention_reference`` on the unsplit arrays. Prints one line per case; exits 1 on the
first mismatch.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _attention_helpers import ring_and_reference
from jax.sharding import PartitionSpec as P

from ejkernel.modules import FlashAttention, MeanPooling
from ejkernel.ops import (
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
)
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.specs.mean_pooling import mean_pooling_reference
from ejkernel.testing import assert_close, random_normal

AXIS = "sp"
ROWS = P(None, AXIS)


def fail(name: str, err: BaseException) -> None:
    print(f"MISMATCH {name}\n{err}", flush=True)
    sys.exit(1)


def ring_case(
    name: str,
    mesh: Any,
    *,
    b: int,
    s: int,
    hq: int,
    hkv: int,
    d: int,
    layout: str,
    segments: bool = False,
    **statics: Any,
) -> None:
    """Ring attention against the reference on the global arrays: output and gradients."""
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(s * 31 + hq), 4)
    arrays = {
        "query": random_normal(kq, (b, s, hq, d)),
        "key": random_normal(kk, (b, s, hkv, d)),
        "value": random_normal(kv, (b, s, hkv, d)),
    }
    if segments:
        # Packed documents crossing shard borders, and padding (-1) at the end of batch row 1.
        ids = jnp.cumsum(jax.random.bernoulli(kc, 0.15, (b, s)), axis=1).astype(jnp.int32)
        ids = ids.at[1, s - 5 :].set(-1)
        arrays.update(q_segment_ids=ids, kv_segment_ids=ids)
    cotangent = random_normal(jax.random.PRNGKey(9), (b, s, hq, d))
    both = ring_and_reference(mesh, AXIS, tuple(arrays), layout, cotangent, **statics)

    start = time.perf_counter()
    (out, grads), (ref_out, ref_grads) = both(arrays)
    try:
        assert_close(out, ref_out, name=f"{name}: out")
        for k in ("query", "key", "value"):
            assert_close(grads[k], ref_grads[k], name=f"{name}: d{k}")
    except AssertionError as err:
        fail(name, err)
    print(f"ok {name} ({time.perf_counter() - start:.1f}s)", flush=True)


class _Scale(Kernel[Any, Any]):
    """A user kernel whose heuristic records the shapes it was chosen for."""

    seen: list[tuple[int, ...]]

    def __init__(self) -> None:
        super().__init__("scale_rows")
        self.seen = []

    def heuristic_cfg(self, inv: Invocation) -> Any:
        self.seen.append(tuple(inv.args[0].shape))
        return 2.0

    def run(self, x: Any, *, cfg: Any, **kwargs: Any) -> Any:
        return x * cfg


def executor_cases(n: int) -> None:
    """``Executor(...)(kernel, *args, method="shard_map", ...)`` on two ops and a user kernel."""
    mesh = jax.make_mesh((n,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    q = random_normal(jax.random.PRNGKey(1), (2 * n, 37, 4, 16))
    k = random_normal(jax.random.PRNGKey(2), (2 * n, 37, 2, 16))
    options = {"mesh": mesh, "in_specs": P("dp"), "out_specs": P("dp")}
    start = time.perf_counter()
    try:
        out = executor(FlashAttention(), q, k, k, causal=True, method="shard_map", **options)
        assert_close(out, flash_attention_reference(q, k, k, causal=True), name="flash")
        x = random_normal(jax.random.PRNGKey(3), (2 * n, 13, 24))
        pooled = executor(MeanPooling(), x, method="shard_map", check_vma=False, **options)
        assert_close(pooled, mean_pooling_reference(x), name="mean_pooling")
        kernel = _Scale()
        y = random_normal(jax.random.PRNGKey(4), (4 * n, 5))
        scaled = executor(kernel, y, method="shard_map", **options)
        np.testing.assert_allclose(np.asarray(scaled), 2.0 * np.asarray(y))
        assert kernel.seen == [(4, 5)], f"config chosen for {kernel.seen}, not the shard (4, 5)"
    except AssertionError as err:
        fail("executor", err)
    print(f"ok executor-shard_map ({time.perf_counter() - start:.1f}s)", flush=True)


#: Ring cases per device count: name -> :func:`ring_case`'s keywords.
RING_CASES: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "n2-contiguous-causal-gqa-segments-softcap": dict(
            b=2,
            s=24,
            hq=4,
            hkv=2,
            d=16,
            layout="contiguous",
            segments=True,
            causal=True,
            logits_soft_cap=3.0,
        ),
        "n2-zigzag-causal-mqa": dict(b=1, s=16, hq=2, hkv=1, d=8, layout="zigzag", causal=True),
        # Local shards longer than one XLA block: the steps' loops carry varying state
        # (shard_map's replication typing must hold through them).
        "n2-contiguous-causal-several-blocks": dict(
            b=1, s=320, hq=2, hkv=1, d=8, layout="contiguous", causal=True
        ),
        "n2-contiguous-window-blockwise": dict(
            b=1, s=20, hq=2, hkv=2, d=8, layout="contiguous", sliding_window=(6, 3)
        ),
    },
    4: {
        "n4-zigzag-causal-gqa-segments": dict(
            b=2, s=40, hq=4, hkv=2, d=16, layout="zigzag", segments=True, causal=True
        ),
        "n4-contiguous-noncausal-gqa-scale": dict(
            b=1, s=36, hq=4, hkv=2, d=8, layout="contiguous", softmax_scale=0.2
        ),
    },
}


def main(n: int) -> None:
    if jax.device_count() != n:
        print(f"expected {n} devices, JAX sees {jax.device_count()}: set XLA_FLAGS first")
        sys.exit(2)
    jax.config.update("jax_disable_most_optimizations", True)
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    for name, case in RING_CASES[n].items():
        ring_case(name, mesh, **case)
    if n == 2:
        executor_cases(n)


if __name__ == "__main__":
    main(int(sys.argv[1]))
