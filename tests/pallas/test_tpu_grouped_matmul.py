"""The Pallas Mosaic-TPU grouped_matmul (megablox form) in TPU interpret mode on the CPU, against
the spec's reference and JAX's own megablox ``gmm``/``tgmm``; its work list; its blocks and
budgets; its lowering to Mosaic modules.

Shapes stay tiny (128-row tiles, one or two blocks per dim): the interpreter simulates every
block copy. Routings are hostile: empty groups first, in the middle and last, groups straddling
tiles, rows past ``sum(group_sizes)``, M, K and N not multiples of 128.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas._gmm_helpers import gmm_inputs, transposed_rhs_inputs
from tests.pallas._mosaic_tpu import mosaic_ops

import ejkernel
from ejkernel.ops import Invocation
from ejkernel.specs.grouped_matmul import SPEC
from ejkernel.testing import assert_close
from ejkernel_pallas.tpu import _gmm_metadata as metadata
from ejkernel_pallas.tpu import _paged
from ejkernel_pallas.tpu import grouped_matmul as module
from ejkernel_pallas.tpu.grouped_matmul import (
    GroupedMatmulConfig,
    config_space,
    grouped_matmul_pallas,
    heuristic,
    supports,
)

SMALL = GroupedMatmulConfig(block_m=128, block_k=128, block_n=128)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


def inputs(
    m: int, k: int, n: int, sizes: Any, dtype: str = "float32", seed: int = 0, **options: Any
) -> dict[str, Any]:
    """Validated arguments (float32 unless said), as the core hands them over."""
    return gmm_inputs(m, k, n, sizes, dtype, seed, **options)


def reference_grads(args: dict[str, Any], d_out: jax.Array) -> tuple[jax.Array, jax.Array]:
    f = lambda lhs, rhs: SPEC.reference(**{**args, "lhs": lhs, "rhs": rhs})
    return jax.vjp(f, args["lhs"], args["rhs"])[1](d_out)


def public_value_and_grads(args: dict[str, Any], d_out: jax.Array, cfg: Any) -> Any:
    """Output and (d_lhs, d_rhs) of ``ejkernel.grouped_matmul(platform="pallas")`` under jit:
    the gradients come through the executor's custom VJP."""
    static = {n: args[n] for n in ("transpose_rhs", "preferred_element_type")}

    def f(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return ejkernel.grouped_matmul(
            lhs, rhs, args["group_sizes"], **static, platform="pallas", cfg=cfg
        )

    out, vjp = jax.jit(lambda lhs, rhs: jax.vjp(f, lhs, rhs))(args["lhs"], args["rhs"])
    return out, vjp(d_out)


def check(args: dict[str, Any], cfg: Any = SMALL, dtype: Any = None) -> jax.Array:
    out, (d_lhs, d_rhs) = public_value_and_grads(
        args, d_out := jnp.asarray(np.random.default_rng(1).normal(size=_out_shape(args))), cfg
    )
    d_out = d_out.astype(out.dtype)
    ref = SPEC.reference(**args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, dtype=dtype, name="out")
    ref_lhs, ref_rhs = reference_grads(args, d_out)
    assert d_lhs.dtype == args["lhs"].dtype and d_rhs.dtype == args["rhs"].dtype
    assert_close(d_lhs, ref_lhs, dtype=dtype, name="d_lhs")
    assert_close(d_rhs, ref_rhs, dtype=dtype, name="d_rhs")
    return out


def _out_shape(args: dict[str, Any]) -> tuple[int, int]:
    rhs = args["rhs"].shape
    return args["lhs"].shape[0], rhs[1] if args["transpose_rhs"] else rhs[2]


def test_empty_groups_and_rows_past_the_total_match_the_reference_in_float32() -> None:
    # M = 37, K = 80, N = 48: one padded block each; rows 34..36 belong to no group.
    args = inputs(37, 80, 48, (0, 7, 0, 13, 9, 5, 0))
    out = check(args)
    assert not np.any(np.asarray(out[34:]))


def test_groups_straddling_tiles_over_several_k_and_n_blocks_in_float32() -> None:
    # 3 row tiles, 2 K blocks (200), 2 N blocks (130); a group spanning all three tiles.
    check(inputs(300, 200, 130, (5, 0, 260, 30, 0)))


def test_bfloat16_transposed_rhs_with_a_float32_output() -> None:
    args = transposed_rhs_inputs(40, "bfloat16")
    out = check(args, cfg=None, dtype=jnp.bfloat16)
    assert out.dtype == jnp.float32


def test_every_group_empty_gives_zeros_and_zero_gradients() -> None:
    args = inputs(20, 16, 24, (0, 0, 0))
    out, (d_lhs, d_rhs) = public_value_and_grads(args, jnp.ones((20, 24)), SMALL)
    assert not np.any(np.asarray(out))
    assert not np.any(np.asarray(d_lhs)) and not np.any(np.asarray(d_rhs))


def test_a_total_past_m_truncates_the_last_groups() -> None:
    args = inputs(50, 16, 24, (30, 40, 9))  # group 1 ends at row 50, group 2 has no row
    out, (_, d_rhs) = public_value_and_grads(args, jnp.ones((50, 24)), SMALL)
    assert_close(out, SPEC.reference(**args), name="truncated")
    assert not np.any(np.asarray(d_rhs[2]))


def test_no_rows_is_an_empty_call() -> None:
    args = inputs(0, 16, 24, (0, 0))
    assert grouped_matmul_pallas(**args).shape == (0, 24)


def _megablox_interpret() -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())


def test_matches_jax_megablox_gmm_and_tgmm_in_interpret_mode() -> None:
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    # Megablox needs M a multiple of its tile and the groups to cover every row.
    args = inputs(256, 128, 128, (100, 0, 120, 36), preferred_element_type="float32")
    lhs, rhs, sizes = args["lhs"], args["rhs"], args["group_sizes"]
    d_out = jnp.asarray(np.random.default_rng(2).normal(size=(256, 128)), jnp.float32)
    ours = grouped_matmul_pallas(**args, cfg=SMALL)
    _, residuals = module.grouped_matmul_pallas.fwd(**args, cfg=SMALL)
    grads = module.grouped_matmul_pallas.bwd(
        residuals, d_out, cfg=SMALL, preferred_element_type="float32", transpose_rhs=False
    )
    with _megablox_interpret():
        theirs = gmm(lhs, rhs, sizes, jnp.float32, (128, 128, 128))
        d_rhs = tgmm(lhs.T, d_out, sizes, jnp.float32, (128, 128, 128))
    assert_close(ours, theirs, name="gmm")
    assert_close(grads["rhs"], d_rhs, name="tgmm")


ROUTINGS = [(0, 7, 0, 13, 9, 5, 0), (300,), (0, 0, 0), (128, 0, 128), (64, 500, 9)]


@pytest.mark.parametrize("block_m", [16, 128])
def test_work_lists_visit_tiles_and_groups_consecutively_within_the_bound(block_m: int) -> None:
    m = 300
    num_tiles = -(-m // block_m)
    plans = jax.jit(
        lambda gs: (
            metadata.row_plan(gs, m=m, block_m=block_m),
            metadata.group_plan(gs, m=m, block_m=block_m),
        )
    )
    for sizes in ROUTINGS:
        rows, groups = jax.tree.map(np.asarray, plans(jnp.asarray(sizes, jnp.int32)))
        steps = metadata.row_steps(num_tiles, len(sizes))
        offsets = rows.offsets
        assert offsets[0] == 0 and offsets[-1] == num_tiles * block_m
        assert np.all(np.diff(offsets) >= 0) and offsets[-2] == min(sum(sizes), m)
        for plan in (rows, groups):
            assert plan.group.shape == plan.tile.shape == plan.valid.shape == (steps,)
            live = plan.valid.astype(bool)
            assert live[0] and np.all(np.diff(plan.valid) <= 0)  # the filler comes last
        # Forward: every row in exactly one visited (tile, group) pair; tiles never revisited.
        live = rows.valid == 1
        tiles, owners = rows.tile[live], rows.group[live]
        assert np.all(np.diff(tiles) >= 0) and set(tiles) == set(range(num_tiles))
        covered = np.zeros(num_tiles * block_m, int)
        for tile, group in zip(tiles, owners, strict=True):
            r = np.arange(tile * block_m, (tile + 1) * block_m)
            covered[r] += (r >= offsets[group]) & (r < offsets[group + 1])
        assert np.all(covered == 1), sizes
        # tgmm: every group (empty ones too) visited in one run, in order.
        owners = groups.group[groups.valid == 1]
        assert np.all(np.diff(owners) >= 0) and set(owners) == set(range(len(sizes))), sizes


def test_heuristic_and_space_obey_the_lane_tiling_and_the_vmem_budget() -> None:
    args = inputs(37, 80, 48, (7, 0, 30))
    inv = Invocation(kernel="grouped_matmul", kwargs=args)
    cfg = heuristic(inv)
    assert (cfg.block_m, cfg.block_k, cfg.block_n) == (128, 128, 128)
    space = config_space(inv)
    assert space[0] == cfg and len(space) == len(set(space)) == 1
    big = {
        **args,
        "lhs": jax.ShapeDtypeStruct((65536, 4096), jnp.bfloat16),
        "rhs": jax.ShapeDtypeStruct((8, 4096, 1408), jnp.bfloat16),
        "group_sizes": jax.ShapeDtypeStruct((8,), jnp.int32),
    }
    big_inv = Invocation(kernel="grouped_matmul", kwargs=big)
    cfg = heuristic(big_inv)
    assert cfg.block_m == 512 and cfg.block_k == 512
    assert cfg.block_n == 512  # 1408 pads to 1536 (by less than an eighth)
    space = config_space(big_inv)
    assert len(space) == 27 and all(b % 128 == 0 for c in space for b in attrs.astuple(c))
    for c in space:
        lp = module._launch(big, c)
        assert module.vmem_bytes(lp, jnp.bfloat16) <= _paged.vmem_budget()
    # Many groups: smaller row tiles waste less on the tiles that straddle groups.
    many = {**big, "rhs": jax.ShapeDtypeStruct((256, 4096, 1408), jnp.bfloat16)}
    assert heuristic(Invocation(kernel="grouped_matmul", kwargs=many)).block_m == 128


def test_supports_declines_float16_and_work_lists_overflowing_smem() -> None:
    args = inputs(37, 80, 48, (7, 0, 30))
    inv = lambda **kw: Invocation(kernel="grouped_matmul", kwargs={**args, **kw})
    assert supports(inv()) is True
    f16 = {n: jax.ShapeDtypeStruct(args[n].shape, jnp.float16) for n in ("lhs", "rhs")}
    assert "float16" in supports(inv(**f16))
    many = {
        "rhs": jax.ShapeDtypeStruct((100_000, 80, 48), jnp.float32),
        "group_sizes": jax.ShapeDtypeStruct((100_000,), jnp.int32),
    }
    assert "SMEM" in supports(inv(**many))
    with pytest.raises(ValueError, match="block_k"):
        GroupedMatmulConfig(block_k=100)


def test_the_public_op_selects_the_pallas_kernel() -> None:
    args = inputs(37, 80, 48, (7, 0, 30))
    arrays = {n: args[n] for n in ("lhs", "rhs", "group_sizes")}
    sel = ejkernel.explain(ejkernel.grouped_matmul, **arrays, platform="pallas")
    assert "ejkernel_pallas.tpu.grouped_matmul" in sel.implementation


@pytest.mark.parametrize(("dtype", "transpose"), [("float32", False), ("bfloat16", True)])
def test_the_kernels_lower_to_mosaic_modules_for_the_tpu(dtype: str, transpose: bool) -> None:
    args = inputs(300, 200, 130, (100, 0, 150), dtype, transpose_rhs=transpose)
    lp = attrs.evolve(module._launch(args, SMALL), interpret=False)
    arrays = [args[n] for n in ("lhs", "rhs", "group_sizes")]
    fwd = module._forward.trace(*arrays, lp=lp).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in fwd and "ejkernel_grouped_matmul_gmm" in fwd
    # The row tile's group and bounds come from SMEM, the product from the MXU.
    assert {"tpu.matmul", "memref.load", "scf.if"} <= mosaic_ops(fwd)
    d_out = jnp.ones((300, 130), dtype)
    bwd = module._backward.trace(*arrays, d_out, lp=lp).lower(lowering_platforms=("tpu",))
    text = bwd.as_text()
    assert "ejkernel_grouped_matmul_gmm" in text and "ejkernel_grouped_matmul_tgmm" in text
    tgmm = mosaic_ops(text, index=1)
    assert {"tpu.matmul", "scf.if"} <= tgmm, sorted(tgmm)
