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
from tests.xla._attention_helpers import ring_and_reference

import ejkernel
from ejkernel.ops import flash_attention_lse_step
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
    local = {k: x[:, : s // n] for k, x in arrays.items()}
    assert flash_attention_lse_step(**local, **statics).platform != "xla"
    cotangent = random_normal(ko, (b, s, hq, d), dtype)
    both = ring_and_reference(mesh, AXIS, tuple(arrays), layout, cotangent, dtype, **statics)
    with jax.default_matmul_precision("highest"):  # the reference's einsums in full float32
        (out, grads), (ref_out, ref_grads) = both(arrays)
    assert_close(out, ref_out, name="out")
    for k in ("query", "key", "value"):
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
