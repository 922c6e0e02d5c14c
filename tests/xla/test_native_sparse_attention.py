"""The XLA native sparse attention against the dense reference: outputs, gradients, options.

Every call goes through the public ``ejkernel.native_sparse_attention`` (the executor picks the
XLA implementation and wires its hand-written backward). Gradients are compared with
``jax.vjp`` of the reference for one random cotangent, for the query, key, value and gates.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel._params import FwdParams
from ejkernel.specs.native_sparse_attention import (
    native_sparse_attention_reference,
    nsa_select_blocks,
)
from ejkernel.testing import assert_close, random_normal
from ejkernel_xla.ops.native_sparse_attention import (
    NativeSparseAttentionConfig,
    config_space,
    heuristic,
)

NAMES = ("query", "key", "value", "g_cmp", "g_slc", "g_swa")


@attrs.frozen(kw_only=True)
class Case:
    """One NSA problem; ``str()`` is a readable test id."""

    b: int
    s: int
    hq: int
    hkv: int
    d: int
    dv: int
    block_size: int
    block_counts: int
    window_size: int
    chunk: int | None = None

    def __str__(self) -> str:
        return (
            f"B{self.b}-S{self.s}-Hq{self.hq}-Hkv{self.hkv}-D{self.d}-Dv{self.dv}-bs{self.block_size}"
            f"-T{self.block_counts}-W{self.window_size}-chunk{self.chunk}"
        )


GQA = Case(
    b=2, s=37, hq=4, hkv=2, d=16, dv=16, block_size=8, block_counts=3, window_size=5, chunk=8
)
MQA = Case(
    b=1, s=67, hq=6, hkv=1, d=32, dv=24, block_size=16, block_counts=2, window_size=0, chunk=16
)
SMALL_BLOCKS = Case(
    b=1, s=45, hq=4, hkv=4, d=16, dv=16, block_size=4, block_counts=5, window_size=9
)


def inputs(case: Case, dtype: Any = jnp.float32, seed: int = 0) -> dict[str, jax.Array]:
    """query, key, value and sigmoid gates from a fixed key."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    gate = lambda k: jax.nn.sigmoid(random_normal(k, (case.b, case.s, case.hq))).astype(dtype)
    return {
        "query": random_normal(ks[0], (case.b, case.s, case.hq, case.d), dtype),
        "key": random_normal(ks[1], (case.b, case.s, case.hkv, case.d), dtype),
        "value": random_normal(ks[2], (case.b, case.s, case.hkv, case.dv), dtype),
        "g_cmp": gate(ks[3]),
        "g_slc": gate(ks[4]),
        "g_swa": gate(ks[5]),
    }


def statics(case: Case, **kwargs: Any) -> dict[str, Any]:
    args = {
        "block_size": case.block_size,
        "block_counts": case.block_counts,
        "window_size": case.window_size,
    }
    return {**args, **kwargs}


def chunk_cfg(case: Case) -> NativeSparseAttentionConfig | None:
    if case.chunk is None:
        return None
    return NativeSparseAttentionConfig(fwd_params=FwdParams(q_blocksize=case.chunk))


def fwd_bwd(fn: Any, arrays: dict[str, Any], d_out: Any = None) -> tuple[Any, dict[str, Any]]:
    """Output and ``jax.vjp`` gradients of ``fn(**arrays)`` for a fixed random cotangent, jitted."""

    @jax.jit
    def run(arrays: dict[str, Any]) -> tuple[Any, Any]:
        out, vjp = jax.vjp(lambda a: fn(**a), arrays)
        ct = random_normal(jax.random.PRNGKey(42), out.shape, out.dtype)
        return out, vjp(ct)[0]

    return run(arrays)


def check(case: Case, dtype: Any = jnp.float32, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """Output and gradients of ejkernel.native_sparse_attention against the reference."""
    arrays = inputs(case, dtype)
    static = statics(case, **kwargs)
    extra = {k: static.pop(k) for k in ("block_indices", "cu_seqlens") if k in static}
    ours = functools.partial(
        ejkernel.native_sparse_attention, **static, **extra, cfg=chunk_cfg(case)
    )
    ref = functools.partial(native_sparse_attention_reference, **static, **extra)
    out, grads = fwd_bwd(ours, arrays)
    ref_out, ref_grads = fwd_bwd(ref, {k: v.astype(jnp.float32) for k, v in arrays.items()})
    assert out.dtype == dtype and out.shape == (case.b, case.s, case.hq, case.dv)
    assert_close(out, ref_out, dtype=dtype, name="out")
    for name in arrays:
        assert grads[name].dtype == dtype
        assert_close(grads[name], ref_grads[name], dtype=dtype, name=f"d{name}")
    return out, grads


@pytest.mark.parametrize("case", [GQA, MQA, SMALL_BLOCKS], ids=str)
def test_output_and_gradients_match_the_reference(case: Case) -> None:
    check(case)


def test_given_block_indices_with_empty_repeated_and_future_slots() -> None:
    # -1 is an empty slot; a repeated block counts once; blocks past the query see nothing.
    idx = jax.random.randint(jax.random.PRNGKey(3), (GQA.b, GQA.s, GQA.hkv, 4), -1, 6)
    idx = idx.at[:, :, :, 3].set(idx[:, :, :, 0])
    check(GQA, block_indices=idx.astype(jnp.int32), softmax_scale=0.4)


def test_packed_sequences_restart_blocks_and_windows_at_each_offset() -> None:
    case = Case(
        b=1, s=70, hq=4, hkv=2, d=16, dv=16, block_size=8, block_counts=3, window_size=6, chunk=16
    )
    # Lengths 13, 27, 1 and 29: partial blocks, a one-token sequence, several complete blocks.
    check(case, cu_seqlens=jnp.array([0, 13, 40, 41, 70], jnp.int32))


def test_window_without_its_gate_is_skipped() -> None:
    arrays = inputs(GQA)
    del arrays["g_swa"]
    ours = ejkernel.native_sparse_attention(**arrays, **statics(GQA), cfg=chunk_cfg(GQA))
    assert_close(ours, native_sparse_attention_reference(**arrays, **statics(GQA)))
    no_window = native_sparse_attention_reference(**arrays, **statics(GQA, window_size=0))
    assert_close(ours, no_window)


def test_bfloat16_matches_the_float32_reference() -> None:
    check(attrs.evolve(GQA, window_size=0), jnp.bfloat16, block_indices=_indices(GQA))


def _indices(case: Case) -> jax.Array:
    """A fixed selection (bf16 logits may reorder near-tied blocks of the computed one)."""
    return jax.random.randint(jax.random.PRNGKey(4), (case.b, case.s, case.hkv, 3), -1, 5)


def test_selection_keeps_forced_blocks_then_the_most_probable() -> None:
    # One query at position 21 of blocks of 4: blocks 0..4 are complete (visible), 5 is current.
    p = jnp.array([0.05, 0.4, 0.1, 0.3, 0.15, 0.0, 0.0])[None, None, None, :]  # [1, 1, G=1, NB]
    pos = jnp.array([[21]])
    pick = lambda count: nsa_select_blocks(
        p[None], pos, block_size=4, block_counts=count, num_blocks=7
    ).ravel()
    # Forced: 0 (first), 5 (current), 4 (previous); then by probability 1, 3, 2.
    assert pick(6).tolist() == [0, 4, 5, 1, 3, 2]
    assert pick(4).tolist() == [0, 4, 5, 1]
    assert pick(9).tolist() == [0, 4, 5, 1, 3, 2, -1, -1, -1]  # block 6 is in the future


def test_chunk_size_does_not_change_the_result() -> None:
    arrays = inputs(MQA)
    one, whole = (
        ejkernel.native_sparse_attention(
            **arrays, **statics(MQA), cfg=chunk_cfg(attrs.evolve(MQA, chunk=chunk))
        )
        for chunk in (1, MQA.s)
    )
    assert_close(one, whole)


def test_jit_and_vmap_match_the_reference() -> None:
    case = GQA
    arrays = inputs(case)
    stacked = {k: jnp.stack([v, -v]) for k, v in arrays.items()}
    ours = jax.jit(jax.vmap(lambda a: ejkernel.native_sparse_attention(**a, **statics(case))))
    ref = jax.vmap(lambda a: native_sparse_attention_reference(**a, **statics(case)))
    assert_close(ours(stacked), ref(stacked))


def test_explain_reports_the_xla_heuristic_and_an_override() -> None:
    arrays = inputs(GQA)
    sel = ejkernel.explain("native_sparse_attention", **arrays, **statics(GQA))
    assert sel.platform == "xla" and sel.source == "heuristic"
    assert isinstance(sel.config, NativeSparseAttentionConfig)
    assert 1 <= sel.config.fwd_params.q_blocksize <= GQA.s
    cfg = chunk_cfg(GQA)
    assert (
        ejkernel.explain("native_sparse_attention", **arrays, **statics(GQA), cfg=cfg).config == cfg
    )


def test_memory_stays_below_dense_attention() -> None:
    s, d = 8192, 32
    shapes = {
        "query": jax.ShapeDtypeStruct((1, s, 2, d), jnp.float32),
        "key": jax.ShapeDtypeStruct((1, s, 1, d), jnp.float32),
        "value": jax.ShapeDtypeStruct((1, s, 1, d), jnp.float32),
        "g_cmp": jax.ShapeDtypeStruct((1, s, 2), jnp.float32),
        "g_slc": jax.ShapeDtypeStruct((1, s, 2), jnp.float32),
    }
    fn = lambda a: jnp.sum(ejkernel.native_sparse_attention(**a, block_size=64, block_counts=4))
    memory = jax.jit(jax.grad(fn)).lower(shapes).compile().memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    dense_logits = s * s * 2 * 4
    assert memory.temp_size_in_bytes < dense_logits / 8


def _good() -> dict[str, Any]:
    return {**inputs(GQA), "block_size": 8}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"key": jnp.zeros((2, 36, 2, 16))}, ValueError, r"`key` must be \[B, S, Hkv, D\]"),
        ({"key": jnp.zeros((2, 37, 3, 16))}, ValueError, r"Hq % Hkv == 0"),
        ({"value": jnp.zeros((2, 37, 1, 16))}, ValueError, r"`value` must be \[B, S, Hkv, Dv\]"),
        (
            {"query": jnp.zeros((2, 37, 4), jnp.float32)},
            ValueError,
            r"`query` must be \[B, S, Hq, D\]",
        ),
        ({"key": jnp.zeros((2, 37, 2, 16), jnp.bfloat16)}, TypeError, "share one dtype"),
        ({"g_cmp": jnp.zeros((2, 37, 2))}, ValueError, r"`g_cmp` must be a floating \[B, S, Hq\]"),
        ({"g_slc": jnp.zeros((2, 37, 4), jnp.int32)}, ValueError, r"`g_slc` must be a floating"),
        ({"g_slc": None}, TypeError, "`g_slc` is required"),
        ({"block_size": 0}, ValueError, "`block_size` must be >= 1"),
        ({"block_counts": 2.5}, TypeError, "`block_counts` must be an int"),
        ({"window_size": -1}, ValueError, "`window_size` must be >= 0"),
        (
            {"block_indices": jnp.zeros((2, 37, 4, 3), jnp.int32)},
            ValueError,
            r"`block_indices` must be \[B, S, Hkv, T\]",
        ),
        (
            {"block_indices": jnp.zeros((2, 37, 2, 3))},
            TypeError,
            "`block_indices` must be an integer",
        ),
        ({"cu_seqlens": jnp.array([0, 37])}, ValueError, "needs B == 1"),
        (
            {"cu_seqlens": jnp.array([[0, 37]])},
            ValueError,
            r"`cu_seqlens` must be \[N \+ 1\]",
        ),
    ],
    ids=[
        "short-key",
        "heads-not-dividing",
        "value-heads",
        "query-3d",
        "mixed-dtypes",
        "gate-heads",
        "integer-gate",
        "missing-gate",
        "block-size-0",
        "float-block-counts",
        "negative-window",
        "indices-heads",
        "float-indices",
        "cu-seqlens-batch-2",
        "cu-seqlens-2d",
    ],
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    change: dict[str, Any], error: type, match: str
) -> None:
    args = {**_good(), **change}
    with pytest.raises(error, match=f"^native_sparse_attention: .*{match}"):
        ejkernel.native_sparse_attention(**args)


def test_autotuning_inputs_are_valid_packed_sequences() -> None:
    from ejkernel.specs.native_sparse_attention import SPEC

    abstract = {
        **{n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in inputs(GQA).items()},
        "block_indices": jax.ShapeDtypeStruct((GQA.b, GQA.s, GQA.hkv, 3), jnp.int32),
        "cu_seqlens": jax.ShapeDtypeStruct((4,), jnp.int32),
    }
    made = SPEC.make_synthetic(abstract)
    cu = made["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == GQA.s and cu == sorted(cu)
    assert made["block_indices"].shape == (GQA.b, GQA.s, GQA.hkv, 3)


class _Invocation:
    def __init__(self, case: Case) -> None:
        self.kwargs = {**inputs(case), **statics(case), "block_indices": None}
        self.metadata = {"grad": True}


def test_configs_use_chunks_no_longer_than_the_sequence() -> None:
    inv = _Invocation(GQA)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space))
    assert all(1 <= cfg.fwd_params.q_blocksize <= GQA.s for cfg in space)
