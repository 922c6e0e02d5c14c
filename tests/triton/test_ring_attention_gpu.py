"""Ring attention over 2 and 4 GPUs of one host: ``ejkernel.ring_attention`` inside
``jax.shard_map`` against the reference on the unsplit arrays, output and gradients, causal and
not, contiguous and zigzag, GQA, packed documents; each ring step on the fastest installed
flash-attention kernel with the (out, lse) contract, never the XLA step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import ejkernel
from ejkernel.ops import flash_attention_lse_step, undo_zigzag_layout, zigzag_layout
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close, random_normal

pytestmark = pytest.mark.gpu

AXIS = "sp"
ROWS = P(None, AXIS)

CASES = {
    "causal-contiguous-gqa": dict(layout="contiguous", hq=8, hkv=2, causal=True),
    "causal-zigzag-gqa": dict(layout="zigzag", hq=8, hkv=2, causal=True),
    "full-contiguous-mha": dict(layout="contiguous", hq=4, hkv=4, causal=False),
    "causal-contiguous-segments-softcap": dict(
        layout="contiguous", hq=4, hkv=2, causal=True, segments=True, logits_soft_cap=20.0
    ),
}


def mesh_of(n: int) -> Any:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} GPUs, JAX sees {jax.device_count()}")
    return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def ring_vs_reference(
    n: int,
    *,
    layout: str,
    hq: int,
    hkv: int,
    dtype: Any,
    s: int = 2048,
    d: int = 128,
    b: int = 2,
    segments: bool = False,
    **statics: Any,
) -> None:
    mesh = mesh_of(n)
    kq, kk, kv, kc, ko = jax.random.split(jax.random.PRNGKey(s + hq), 5)
    arrays = {
        "query": random_normal(kq, (b, s, hq, d), dtype),
        "key": random_normal(kk, (b, s, hkv, d), dtype),
        "value": random_normal(kv, (b, s, hkv, d), dtype),
    }
    if segments:
        ids = jnp.cumsum(jax.random.bernoulli(kc, 0.002, (b, s)), axis=1).astype(jnp.int32)
        arrays.update(q_segment_ids=ids, kv_segment_ids=ids)
    names = tuple(arrays)
    local = {k: x[:, : s // n] for k, x in arrays.items()}
    assert flash_attention_lse_step(**local, **statics).platform != "xla"

    def sharded(*xs: Any) -> Any:
        return ejkernel.ring_attention(
            **dict(zip(names, xs)), axis_name=AXIS, layout=layout, **statics
        )

    ring = jax.shard_map(sharded, mesh=mesh, in_specs=ROWS, out_specs=ROWS)

    def ours(arrs: dict[str, Any]) -> Any:
        xs = [arrs[k] for k in names]
        if layout == "zigzag":
            return undo_zigzag_layout(ring(*(zigzag_layout(x, n) for x in xs)), n)
        return ring(*xs)

    def reference(arrs: dict[str, Any]) -> Any:
        wide = {k: x.astype(jnp.float32) if x.dtype == dtype else x for k, x in arrs.items()}
        return flash_attention_reference(**wide, **statics)

    diff = ("query", "key", "value")
    cotangent = random_normal(ko, (b, s, hq, d), dtype)

    @jax.jit
    def both(arrs: dict[str, Any]) -> Any:
        fixed = {k: x for k, x in arrs.items() if k not in diff}
        results = []
        for fn in (ours, reference):
            out, vjp = jax.vjp(lambda w, fn=fn: fn({**w, **fixed}), {k: arrs[k] for k in diff})
            results.append((out, vjp(cotangent.astype(out.dtype))[0]))
        return results

    with jax.default_matmul_precision("highest"):  # the reference's einsums in full float32
        (out, grads), (ref_out, ref_grads) = both(arrays)
    assert_close(out, ref_out, name="out")
    for k in diff:
        assert_close(grads[k], ref_grads[k], name=f"d{k}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", [2, 4], ids=["2-gpus", "4-gpus"])
def test_ring_on_gpus_matches_the_reference_on_the_global_arrays(
    n: int, case: str, dtype: Any
) -> None:
    ring_vs_reference(n, dtype=dtype, **CASES[case])


def test_ring_memory_per_gpu_shrinks_with_the_number_of_gpus() -> None:
    """Compiled temporaries per device of a causal zigzag forward+backward at S 65536: each
    device holds S/N rows, so four GPUs need at most about half of what two need."""
    temps = {}
    for n in (2, 4):
        mesh = mesh_of(n)
        shape = (1, 65536, 8, 128)
        q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

        def loss(q: Any, k: Any, v: Any, mesh: Any = mesh) -> Any:
            ring = jax.shard_map(
                lambda *xs: ejkernel.ring_attention(
                    *xs, axis_name=AXIS, layout="zigzag", causal=True
                ),
                mesh=mesh,
                in_specs=ROWS,
                out_specs=ROWS,
            )
            return ring(q, k, v).astype(jnp.float32).sum()

        sharding = jax.sharding.NamedSharding(mesh, ROWS)
        compiled = (
            jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(sharding,) * 3)
            .lower(q, q, q)
            .compile()
        )
        temps[n] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[4] <= 0.6 * temps[2], temps
