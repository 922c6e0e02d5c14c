"""The Triton native sparse attention against the reference.

Through Triton's interpreter on the CPU (``interpret``): output and the gradients of query,
key, value and the three gates against autodiff of
:func:`native_sparse_attention_reference`, with the selection made from the compressed branch
or given (repeats, empty slots, blocks after the query), GQA and MQA groups, head and block
sizes that are not powers of two, packed sequences shorter than a block and empty, the sliding
window, bf16, and non-finite keys and values (read as 0). Marked ``gpu``: a realistic shape in
bfloat16 against the XLA platform in float32.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._linear_helpers import check_against, rel

import ejkernel
from ejkernel.specs.native_sparse_attention import native_sparse_attention_reference as reference
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.native_sparse_attention import (
    COMPRESSED_BYTES,
    NativeSparseAttentionConfig,
    config_space,
    heuristic,
    supports,
)


def inputs(
    b: int, s: int, hq: int, hkv: int, d: int, dv: int, dtype: Any = jnp.float32
) -> dict[str, jax.Array]:
    ks = jax.random.split(jax.random.PRNGKey(s * 7 + d + hq), 6)
    gate = lambda i: jax.nn.sigmoid(normal(ks[i], (b, s, hq), jnp.float32)).astype(dtype)
    return {
        "query": normal(ks[0], (b, s, hq, d), dtype),
        "key": normal(ks[1], (b, s, hkv, d), dtype),
        "value": normal(ks[2], (b, s, hkv, dv), dtype),
        "g_cmp": gate(3),
        "g_slc": gate(4),
        "g_swa": gate(5),
    }


def ours(**kw: Any) -> Any:
    return ejkernel.native_sparse_attention(**kw, platform="triton")


def check(arrays: dict[str, jax.Array], tol: float = 1e-5, **statics: Any) -> None:
    """Output and gradients against the reference, each side jitted with its static arguments
    (JAX's eager dispatch of the JAX parts would take most of the interpreter's time)."""
    mine = jax.jit(functools.partial(ours, **statics))
    want = jax.jit(functools.partial(reference, **statics))
    check_against(lambda **a: mine(**a), lambda **a: want(**a), arrays, tol=tol)


@pytest.mark.parametrize(
    ("shape", "statics"),
    [
        ((1, 37, 2, 1, 16, 8), {"block_size": 8, "block_counts": 3}),
        ((2, 29, 4, 1, 80, 48), {"block_size": 12, "block_counts": 2}),
        ((1, 40, 2, 2, 16, 16), {"block_size": 16, "block_counts": 4, "window_size": 40}),
    ],
    ids=["gqa", "mqa-d80-bs12", "more-slots-than-blocks-window"],
)
def test_output_and_gradients_match_the_reference(interpret, shape, statics) -> None:
    arrays = inputs(*shape)
    if not statics.get("window_size"):
        del arrays["g_swa"]
    check(arrays, softmax_scale=0.3, **statics)


def test_given_blocks_with_repeats_empty_slots_and_future_blocks(interpret) -> None:
    arrays = inputs(1, 40, 4, 2, 16, 16)
    del arrays["g_swa"]
    slots = jax.random.randint(jax.random.PRNGKey(1), (1, 40, 2, 4), -1, 6)
    slots = slots.at[..., 3].set(slots[..., 0])  # a repeat of the first slot
    check(arrays, block_size=8, block_indices=slots)


def test_packed_sequences_shorter_than_a_block_and_empty(interpret) -> None:
    arrays = inputs(1, 50, 2, 1, 16, 8)
    cu = jnp.array([0, 5, 5, 29, 30, 50], jnp.int32)
    check(
        arrays,
        block_size=8,
        block_counts=3,
        window_size=6,
        cu_seqlens=cu,
    )


def test_non_finite_keys_and_values_read_as_zero(interpret) -> None:
    arrays = inputs(1, 33, 2, 1, 16, 8)
    del arrays["g_swa"]
    arrays["key"] = arrays["key"].at[0, 20, 0, 3].set(jnp.nan)
    arrays["value"] = arrays["value"].at[0, 9, 0, 2].set(jnp.inf)
    statics = {"block_size": 8, "block_counts": 2}
    out = jax.jit(functools.partial(ours, **statics))(**arrays)
    want = reference(**arrays, **statics)
    assert bool(jnp.isfinite(out).all())
    assert rel(out, want) < 1e-5


def test_half_precision_within_a_half_precision_tolerance(interpret) -> None:
    arrays = inputs(1, 37, 4, 2, 16, 16, jnp.bfloat16)
    check(arrays, tol=2e-2, block_size=8, block_counts=3, window_size=5)


def test_pairs_by_block_cover_every_visible_pair_once_in_runs_of_one_block() -> None:
    """The dk/dv work items: two packed sequences (the second's blocks start off the global
    grid), empty slots and a block after its query (left out)."""
    import numpy as np

    from ejkernel_triton.ops.native_sparse_attention import pairs_by_block

    s, bs, t = 20, 4, 3
    start = jnp.asarray([0] * 9 + [9] * 11, jnp.int32)
    rng = np.random.default_rng(0)
    idx = rng.integers(-1, 4, size=(2, s, 1, t)).astype(np.int32)
    idx[..., 1:] = np.where(idx[..., 1:] == idx[..., :1], -1, idx[..., 1:])  # first slots
    idx[..., 2] = np.where(idx[..., 2] == idx[..., 1], -1, idx[..., 2])
    tok, items = pairs_by_block(jnp.asarray(idx), start, bs, blocks=3 + 2, per_item=2)
    tok, items = np.asarray(tok), np.asarray(items)
    for b in range(2):
        want = sorted(
            (int(start[q]) + c * bs, q)
            for q in range(s)
            for c in idx[b, q, 0]
            if c >= 0 and c * bs <= q - int(start[q])
        )
        got = []
        for r0, lo, hi in items[b, 0]:
            assert hi - lo <= 2
            got += [(int(r0), int(tok[b, 0, p])) for p in range(lo, hi)]
        assert sorted(got) == want


def test_registered_above_the_xla_fallback() -> None:
    from ejkernel_triton import plugin

    assert "native_sparse_attention" in plugin.OPS
    assert "native_sparse_attention" not in plugin.OPT_IN


def test_supports_declines_what_the_kernels_do_not_hold() -> None:
    def inv(s: int, d: int = 16, dtype: Any = jnp.bfloat16, **kw: Any) -> Any:
        q = jax.ShapeDtypeStruct((1, s, 64, d), dtype)
        k = jax.ShapeDtypeStruct((1, s, 4, d), dtype)
        return types.SimpleNamespace(kwargs={"query": q, "key": k, "value": k, **kw})

    assert supports(inv(8192)) is True
    assert supports(inv(65536)) is True  # 4 KV heads × 64k queries × 1024 blocks: 1 GiB
    assert "GiB" in supports(inv(131072))
    assert COMPRESSED_BYTES < 4 * 131072 * 4 * 2048
    assert "head dims" in supports(inv(64, d=320))
    assert "block_size" in supports(inv(64, block_size=512))
    assert "dtypes" in supports(inv(64, dtype=jnp.float64))
    space = config_space(inv(8192))
    assert space[0] == heuristic(inv(8192)) == NativeSparseAttentionConfig()


def test_kernels_compile_for_hopper_with_matrix_instructions(monkeypatch, tmp_path) -> None:
    """The selected and compressed branches' forward and backward (bf16, D 128, 16 heads per KV
    head, blocks of 64), compiled for sm_90 on any machine."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import native_sparse_attention as nsa

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    q = jnp.ones((1, 128, 32, 128), jnp.bfloat16)
    k = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
    idx = jnp.zeros((1, 128, 2, 4), jnp.int32)
    start = jnp.zeros((128,), jnp.int32)
    cfg = NativeSparseAttentionConfig()
    kc = jnp.ones((1, 2, 2, 128), jnp.float32)
    span = jnp.arange(128, dtype=jnp.int32) // 64
    with _codegen.recorded_launches() as record:
        o, res = nsa._selected_fwd(q, k, k, idx, start, 0.1, 64, 2, cfg)
        nsa._selected_bwd(0.1, 64, 2, cfg, res, o)
        (oc, lse), res = nsa._compressed_fwd(q, kc, kc, jnp.zeros_like(span), span, 0.1)
        nsa._scores(q, kc, lse, jnp.zeros_like(span), span, 0.1, 2)
        nsa._compressed_bwd(0.1, res, (oc, lse))
    assert [launch.kernel.fn.__name__ for launch in record] == [
        "nsa_selected_fwd_kernel",
        "nsa_selected_bwd_kernel",
        "nsa_selected_bwd_dkv_kernel",
        "nsa_compressed_fwd_kernel",
        "nsa_compressed_scores_kernel",
        "nsa_compressed_bwd_dq_kernel",
        "nsa_compressed_bwd_dkv_kernel",
    ]
    for launch in record:
        compiled = _codegen.compile_launch(launch, capability=90)
        mix = _codegen.instruction_mix(compiled.ptx)
        assert any(k.startswith(("wgmma", "mma")) for k in mix), launch.kernel.fn.__name__


# -- GPU, a realistic shape -----------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_output_and_gradients_match_the_xla_path() -> None:
    """B 1, S 4096, 32 query heads over 2 KV heads, D 128, blocks of 64, 16 given blocks (a
    selection from bf16 scores may differ from the float32 one where two blocks nearly tie), a
    window of 512: bf16 through the Triton platform against the XLA platform in float32."""
    arrays = inputs(1, 4096, 32, 2, 128, 128, jnp.bfloat16)
    slots = jax.random.randint(jax.random.PRNGKey(2), (1, 4096, 2, 16), -1, 64)
    statics = {"block_size": 64, "block_indices": slots, "window_size": 512}

    def run(platform: str, a: dict[str, jax.Array]) -> Any:
        def loss(a: dict[str, jax.Array]) -> Any:
            out = ejkernel.native_sparse_attention(**a, **statics, platform=platform)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1]))), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(a)
        return out, grads

    out, got = run("triton", arrays)
    want, exp = run("xla", jax.tree.map(lambda x: x.astype(jnp.float32), arrays))
    assert rel(out, want) < 2e-2
    for name in arrays:
        assert rel(got[name], exp[name]) < 3e-2, name
