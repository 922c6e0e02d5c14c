"""The Pallas Mosaic-GPU grouped matmul: its work list, config rules, and the kernels on a
Hopper GPU (``gpu`` marker) and in Mosaic GPU's interpret mode on the CPU.

The same checks run in both modes: ``gpu`` through the public op (``platform="pallas"``) under
``jax.jit``, gradients through the executor's VJP; ``interpret`` calls the module's entry and
VJP halves directly (the GPU family is not registered for the CPU). Routings are hostile: empty
groups first, in the middle and last, one-row groups, rows past ``sum(group_sizes)``, a total
past M, K and N not multiples of the blocks.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas._gmm_helpers import gmm_inputs, transposed_rhs_inputs

import ejkernel
from ejkernel.ops import Invocation
from ejkernel.specs.grouped_matmul import SPEC
from ejkernel.testing import assert_close
from ejkernel_pallas.gpu import grouped_matmul as module
from ejkernel_pallas.gpu.grouped_matmul import GroupedMatmulConfig, work_list

HAS_ABSL = importlib.util.find_spec("absl") is not None
SMALL = GroupedMatmulConfig(block_m=64, block_n=64, block_k=64, stages=2)

GPU = pytest.mark.gpu
INTERPRET = pytest.mark.skipif(not HAS_ABSL, reason="Mosaic GPU interpret mode needs absl-py")


def inputs(
    m: int, k: int, n: int, sizes: Any, dtype: str = "bfloat16", seed: int = 0, **options: Any
) -> dict[str, Any]:
    """Validated arguments (bfloat16 unless said), as the core hands them over."""
    return gmm_inputs(m, k, n, sizes, dtype, seed, **options)


def run(mode: str, args: dict[str, Any], d_out: jax.Array, cfg: Any) -> Any:
    """``(out, (d_lhs, d_rhs))`` of the kernels in ``mode``."""
    static = {n: args[n] for n in ("transpose_rhs", "preferred_element_type")}
    if mode == "gpu":
        if jax.default_backend() != "gpu":
            pytest.skip("needs a GPU")

        def f(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            return ejkernel.grouped_matmul(
                lhs, rhs, args["group_sizes"], **static, platform="pallas", cfg=cfg
            )

        out, vjp = jax.jit(lambda lhs, rhs: jax.vjp(f, lhs, rhs))(args["lhs"], args["rhs"])
        return out, vjp(d_out)
    if jax.default_backend() != "cpu":
        pytest.skip("interpret mode is exercised on the CPU")
    out = module.grouped_matmul_pallas(**args, cfg=cfg)
    _, residuals = module.grouped_matmul_pallas.fwd(**args, cfg=cfg)
    grads = module.grouped_matmul_pallas.bwd(residuals, d_out, cfg=cfg, **static)
    return out, (grads["lhs"], grads["rhs"])


def check(mode: str, args: dict[str, Any], cfg: Any = SMALL) -> jax.Array:
    """Output and both gradients against the float32 reference."""
    rhs = args["rhs"].shape
    n = rhs[1] if args["transpose_rhs"] else rhs[2]
    out_dtype = jnp.dtype(args["preferred_element_type"])
    d_out = jnp.asarray(np.random.default_rng(1).normal(size=(args["lhs"].shape[0], n)), out_dtype)
    out, (d_lhs, d_rhs) = run(mode, args, d_out, cfg)
    f32 = {
        **args,
        "lhs": args["lhs"].astype(jnp.float32),
        "rhs": args["rhs"].astype(jnp.float32),
        "preferred_element_type": "float32",
    }
    ref, vjp = jax.vjp(
        lambda a, b: SPEC.reference(**{**f32, "lhs": a, "rhs": b}), f32["lhs"], f32["rhs"]
    )
    ref_lhs, ref_rhs = vjp(d_out.astype(jnp.float32))
    assert out.shape == ref.shape and out.dtype == out_dtype
    assert d_lhs.dtype == args["lhs"].dtype and d_rhs.dtype == args["rhs"].dtype
    dtype = args["lhs"].dtype
    assert_close(out, ref, dtype=dtype, name="out")
    assert_close(d_lhs, ref_lhs, dtype=dtype, name="d_lhs")
    assert_close(d_rhs, ref_rhs, dtype=dtype, name="d_rhs")
    return out


# --------------------------------------------------------------------------------------------
# The work list
# --------------------------------------------------------------------------------------------

ROUTINGS = [(0, 7, 0, 13, 9, 5, 0), (300,), (0, 0, 0), (128, 0, 128), (64, 500, 9), (1,) * 12]


@pytest.mark.parametrize("block_m", [64, 128])
def test_work_list_covers_every_row_once_from_aligned_windows(block_m: int) -> None:
    m = 300
    for sizes in ROUTINGS:
        plan = jax.jit(work_list, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m, block_m)
        seg, window, lead, rows = np.asarray(plan)
        assert seg.shape == (-(-m // block_m) + len(sizes) + 1,)
        assert np.all(window % module.ROW_ALIGN == 0)
        owner = np.full(m, -1)
        for s, w, d, r in zip(seg, window, lead, rows, strict=True):
            assert r >= 0 and 0 <= d < module.ROW_ALIGN and d + r <= block_m
            if r:
                f = w + d
                assert np.all(owner[f : f + r] == -1), (sizes, s, w, d, r)
                owner[f : f + r] = s
        ends = np.minimum(np.cumsum(sizes), m)
        expected = np.searchsorted(ends, np.arange(m), side="right")  # the tail is G
        np.testing.assert_array_equal(owner, expected, err_msg=str(sizes))
        live = rows > 0
        assert np.all(live[: live.sum()])  # the filler comes last


# --------------------------------------------------------------------------------------------
# Config rules
# --------------------------------------------------------------------------------------------


def _inv(m: int, k: int, n: int, g: int, dtype: str = "bfloat16", **kw: Any) -> Invocation:
    args = {
        "lhs": jax.ShapeDtypeStruct((m, k), dtype),
        "rhs": jax.ShapeDtypeStruct((g, k, n), dtype),
        "group_sizes": jax.ShapeDtypeStruct((g,), jnp.int32),
        "transpose_rhs": False,
        "preferred_element_type": kw.pop("out", dtype),
    }
    return Invocation(kernel="grouped_matmul", kwargs=args)


def test_supports_declines_what_the_kernels_cannot_run() -> None:
    assert module.supports(_inv(256, 512, 512, 8)) is True
    assert "bfloat16/float16" in module.supports(_inv(256, 512, 512, 8, "float32"))
    assert "multiples of 8" in module.supports(_inv(256, 500, 512, 8))
    assert "multiples of 8" in module.supports(_inv(256, 512, 36, 8))


def test_heuristic_halves_the_tile_for_many_groups_and_fits_shared_memory() -> None:
    many = module.heuristic(_inv(4096, 1024, 1024, 64))  # 64 rows a group: 64-row tiles
    few = module.heuristic(_inv(16384, 4096, 4096, 8))
    # 512 rows a group on average: 128-row tiles (measured faster at this Zipf shape).
    skewed = module.heuristic(_inv(32768, 2048, 1408, 64))
    assert many.block_m == 64 and few.block_m == 128 and few.block_n == 128
    assert skewed.block_m == 128
    limit = 232_448  # an H100's opt-in shared memory per block
    for cfg in (many, few):
        assert module.smem_need(_inv(4096, 1024, 1024, 8).kwargs, cfg) <= limit
    f32_out = _inv(4096, 1024, 1024, 8, out="float32")
    cfg = module.heuristic(f32_out)
    assert module.smem_need(f32_out.kwargs, cfg) <= limit or cfg.stages == 2


def test_heuristic_fills_the_ring_beside_a_half_tile_staging_so_pipelines_chain() -> None:
    # bf16 at 128 x 2·128: 4 slots fit beside half-tile staging (3 beside a whole tile); 32 or
    # 64 steps of 64 are multiples of 4, so a CTA's consecutive pipelines run as one.
    for shape in ((32768, 2048, 1408, 64), (16384, 4096, 4096, 8)):
        inv = _inv(*shape)
        lp = module._launch(inv.kwargs, None)
        assert (lp.block_m, lp.stages, lp.store_m) == (128, 4, 64)
        assert module._chainable(lp, shape[1] // lp.block_k)
        assert not module._chainable(lp, 30)  # 30 steps: a remainder in the ring
        assert module.smem_need(inv.kwargs, module.heuristic(inv)) <= module.HOPPER_SMEM
    # A config of 3 slots keeps a whole-tile staging.
    three = module._launch(_inv(32768, 2048, 1408, 64).kwargs, GroupedMatmulConfig(stages=3))
    assert (three.stages, three.store_m) == (3, 128)


def test_config_space_starts_with_the_heuristic_and_names_distinct_configs() -> None:
    inv = _inv(4096, 1024, 1024, 8)
    space = module.config_space(inv)
    assert space[0] == module.heuristic(inv)
    assert len(space) == len(set(space)) > 4


def test_config_fields_take_only_what_the_kernels_tile() -> None:
    with pytest.raises(ValueError):
        GroupedMatmulConfig(block_m=96)
    with pytest.raises(ValueError):
        GroupedMatmulConfig(stages=9)


# --------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------


@INTERPRET
def test_interpret_small_with_an_empty_group_a_one_row_group_and_unrouted_rows() -> None:
    # M 60, K 72 (two steps, the second mostly padding), N 40; rows 51..59 in no group.
    out = check("interpret", inputs(60, 72, 40, (0, 20, 1, 30)))
    assert not np.any(np.asarray(out[51:]))


@pytest.mark.slow
@INTERPRET
def test_interpret_empty_groups_rows_past_the_total_and_odd_k_n() -> None:
    # M 150, K 72, N 136: rows 130..149 belong to no group (zeros, zero d_lhs).
    out = check("interpret", inputs(150, 72, 136, (0, 40, 1, 0, 70, 19, 0)))
    assert not np.any(np.asarray(out[130:]))


@INTERPRET
def test_interpret_heuristic_config_half_tile_stores_and_chained_pipelines() -> None:
    # The heuristic's 128-row tiles, 4 slots and 64-row output staging; K 256 is 4 steps (the
    # pipelines chain), so each of the 2 simulated SMs runs a first, middle and last pipeline.
    # Groups end inside either half of a tile; rows 751..799 are unrouted.
    args = inputs(800, 256, 136, (0, 300, 1, 350, 100))
    lp = module._launch(args, None)
    assert (lp.block_m, lp.stages, lp.store_m) == (128, 4, 64) and module._chainable(lp, 4)
    out = check("interpret", args, cfg=None)
    assert not np.any(np.asarray(out[751:]))


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_kernels_lower_to_mosaic_gpu_on_any_machine_within_the_estimate(
    out_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CUDA lowering (wgmma accumulators, TMA, chained pipelines, half-tile stores), traced
    # without a GPU; Mosaic GPU's own shared-memory figure is within the estimate.
    import re

    import attrs

    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    limit = getattr(core, "artificial_shared_memory_limit", None)
    if limit is None:
        pytest.skip("this jax has no artificial_shared_memory_limit")
    monkeypatch.setattr(module, "_num_sms", lambda lp: 132)  # an H100's or H200's
    inv = _inv(4096, 2048, 1408, 16, out=out_dtype)
    lp = attrs.evolve(module._launch(inv.kwargs, None), interpret=False)
    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 2048, 1408), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((16,), jnp.int32)
    assert module.smem_need(inv.kwargs, module.heuristic(inv)) <= module.HOPPER_SMEM
    kernels = {
        "gmm": (
            out_dtype,
            lambda x, w, s: module._gmm(x, w, s, lp=lp, transpose_w=False, out_dtype=out_dtype),
        ),
        "d_lhs": (
            "bfloat16",
            lambda x, w, s: module._gmm(
                x[:, :1408], w, s, lp=lp, transpose_w=True, out_dtype="bfloat16"
            ),
        ),
        "tgmm": (
            "bfloat16",
            lambda x, w, s: module._tgmm(x, x[:, :1408], s, lp=lp, out_dtype="bfloat16"),
        ),
    }
    blocks = (lp.block_m, lp.block_n, lp.block_k, lp.stages)
    for name, (dtype, fn) in kernels.items():
        with limit(1), pytest.raises(ValueError, match="exceeds available shared memory") as err:
            jax.jit(fn).trace(x, w, sizes).lower(lowering_platforms=("cuda",))
        allocated = int(re.search(r"smem_bytes=(\d+)", str(err.value))[1])
        estimate = module._kernel_smem(blocks, jnp.bfloat16, jnp.dtype(dtype), lp.store_m)
        assert estimate - 1024 <= allocated <= estimate, (name, allocated, estimate)


@pytest.mark.slow
@INTERPRET
def test_interpret_transposed_rhs_float16_with_a_float32_output() -> None:
    args = transposed_rhs_inputs(80, "float16")
    assert check("interpret", args).dtype == jnp.float32


@pytest.mark.slow
@INTERPRET
def test_interpret_a_total_past_m_truncates_the_last_groups() -> None:
    check("interpret", inputs(100, 64, 64, (30, 90, 9)))


@GPU
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("cfg", [None, SMALL], ids=["heuristic", "small"])
def test_gpu_hostile_routing(transpose_rhs: bool, cfg: Any) -> None:
    sizes = (0, 300, 1, 0, 1000, 77, 129, 0, 500, 3)  # 2010 of 2100 rows
    out = check("gpu", inputs(2100, 200, 264, sizes, transpose_rhs=transpose_rhs), cfg)
    assert not np.any(np.asarray(out[2010:]))


@GPU
def test_gpu_float16_float32_output_and_a_total_past_m() -> None:
    args = inputs(777, 136, 96, (500, 400, 9), "float16", preferred_element_type="float32")
    check("gpu", args)


@GPU
def test_gpu_zipf_routing_over_64_experts_at_scale() -> None:
    rng = np.random.default_rng(3)
    weights = 1.0 / np.arange(1, 65) ** 1.2
    rng.shuffle(weights)
    weights[:4] = 0.0
    sizes = np.floor(weights / weights.sum() * 8192).astype(np.int32)
    check("gpu", inputs(8192, 512, 352, sizes))


@GPU
def test_gpu_default_call_picks_the_pallas_kernel() -> None:
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args = inputs(1024, 256, 256, (500, 0, 524))
    sel = ejkernel.explain(ejkernel.grouped_matmul, args["lhs"], args["rhs"], args["group_sizes"])
    assert sel.implementation.startswith("ejkernel_pallas.gpu."), sel
