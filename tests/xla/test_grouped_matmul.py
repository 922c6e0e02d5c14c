"""The XLA grouped matmul against the reference: routings, layouts, dtypes, gradients, tracing.

Every call goes through the public ``ejkernel.grouped_matmul`` (the executor wires the custom
VJP); gradients are ``jax.vjp`` of it against ``jax.vjp`` of the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.specs.grouped_matmul import grouped_matmul_reference, grouped_matmul_synthetic
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.grouped_matmul import (
    GroupedMatmulConfig,
    config_space,
    heuristic,
)


@attrs.frozen(kw_only=True)
class Routing:
    """One problem: lhs [M, K], G experts of [K, N], and the rows each expert gets."""

    name: str
    sizes: tuple[int, ...]
    m: int = 37
    k: int = 80
    n: int = 48

    def __str__(self) -> str:
        return f"{self.name}-M{self.m}-K{self.k}-N{self.n}-G{len(self.sizes)}"


ROUTINGS = (
    Routing(name="uneven-empty-rows-past-total", sizes=(7, 0, 13, 1, 10)),
    Routing(name="all-rows-in-one-group", sizes=(0, 0, 37, 0)),
    Routing(name="empty-first-and-last", sizes=(0, 20, 17, 0)),
    Routing(name="total-past-M-truncates", sizes=(20, 30, 5)),
    Routing(name="every-group-empty", sizes=(0, 0, 0)),
    Routing(name="one-group", sizes=(37,)),
    Routing(name="skewed", sizes=(1, 90, 0, 3, 0, 17, 2, 16), m=129, k=64, n=80),
)
UNEVEN = ROUTINGS[0]

#: Tiles of 8 rows: groups inside one tile, groups over many, boundaries mid-tile.
SMALL = GroupedMatmulConfig(block_m=8)
#: One tile covering every row.
ONE_TILE = GroupedMatmulConfig(block_m=256)


def inputs(
    r: Routing, dtype: Any = jnp.float32, *, transpose: bool = False, seed: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    k_lhs, k_rhs = jax.random.split(jax.random.PRNGKey(seed))
    g = len(r.sizes)
    rhs_shape = (g, r.n, r.k) if transpose else (g, r.k, r.n)
    return (
        normal(k_lhs, (r.m, r.k), dtype),
        normal(k_rhs, rhs_shape, dtype),
        jnp.asarray(r.sizes, jnp.int32),
    )


def _fwd_bwd(
    fn: Any, r: Routing, dtype: Any, transpose: bool, preferred: Any
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Output and gradients (lhs, rhs) of ``fn`` on the routing's inputs, forward and backward
    in one ``jax.jit`` (one compile); the cotangent is a fixed random normal."""
    lhs, rhs, sizes = inputs(r, dtype, transpose=transpose)
    statics = {"preferred_element_type": preferred, "transpose_rhs": transpose}
    d_out = normal(jax.random.PRNGKey(42), (r.m, r.n), jnp.dtype(preferred or dtype))

    @jax.jit
    def run(lhs: Any, rhs: Any, sizes: Any) -> Any:
        out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes, **statics), lhs, rhs)
        return out, vjp(d_out)

    return run(lhs, rhs, sizes)


@functools.cache
def _reference(
    r: Routing, dtype: Any, transpose: bool, preferred: Any
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The reference's output and gradients, computed once per problem (tiles vary, it not)."""
    return _fwd_bwd(grouped_matmul_reference, r, dtype, transpose, preferred)


def check(
    r: Routing,
    cfg: GroupedMatmulConfig | None = None,
    dtype: Any = jnp.float32,
    *,
    transpose: bool = False,
    preferred: Any = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Compare output and gradients (lhs, rhs) with the reference; return ours."""
    lhs, rhs, _ = inputs(r, dtype, transpose=transpose)
    out_dtype = jnp.dtype(preferred or dtype)
    ours = functools.partial(ejkernel.grouped_matmul, cfg=cfg)
    out, grads = _fwd_bwd(ours, r, dtype, transpose, preferred)
    ref_out, ref_grads = _reference(r, dtype, transpose, preferred)
    assert out.dtype == ref_out.dtype == out_dtype
    assert_close(out, ref_out, name="out")
    for name, grad, ref, x in zip(("lhs", "rhs"), grads, ref_grads, (lhs, rhs)):
        assert grad.shape == x.shape and grad.dtype == x.dtype, name
        assert_close(grad, ref, name=f"d{name}")
    return out, grads


@pytest.mark.parametrize("cfg", [None, SMALL], ids=["heuristic", "block8"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_output_and_gradients_match_the_reference(routing: Routing, cfg: Any) -> None:
    check(routing, cfg)


@pytest.mark.parametrize("routing", [UNEVEN, ROUTINGS[3], ROUTINGS[6]], ids=str)
def test_one_tile_over_every_row_matches_the_reference(routing: Routing) -> None:
    check(routing, ONE_TILE)


def test_rows_past_the_total_and_empty_groups_are_zero_in_output_and_gradients() -> None:
    out, (d_lhs, d_rhs) = check(UNEVEN, SMALL)
    total = sum(UNEVEN.sizes)  # 31 of 37 rows
    assert np.all(np.asarray(out)[total:] == 0.0)
    assert np.all(np.asarray(d_lhs)[total:] == 0.0)
    assert np.all(np.asarray(d_rhs)[1] == 0.0)  # group 1 is empty
    assert np.all(np.asarray(out)[:total] != 0.0)


@pytest.mark.parametrize(
    ("routing", "cfg"),
    [(UNEVEN, None), (UNEVEN, SMALL), (ROUTINGS[6], SMALL)],
    ids=lambda x: str(x) if isinstance(x, Routing) else ("block8" if x else "heuristic"),
)
def test_transposed_rhs_matches_the_reference(routing: Routing, cfg: Any) -> None:
    _, (_, d_rhs) = check(routing, cfg, transpose=True)
    assert d_rhs.shape == (len(routing.sizes), routing.n, routing.k)


@pytest.mark.parametrize(
    ("dtype", "preferred", "transpose"),
    [
        (jnp.bfloat16, None, False),
        (jnp.bfloat16, None, True),
        (jnp.bfloat16, jnp.float32, False),
        (jnp.float32, jnp.bfloat16, True),
        (jnp.bfloat16, "float32", True),
    ],
    ids=["bf16", "bf16-rhs-NK", "bf16-to-f32", "f32-to-bf16-rhs-NK", "bf16-to-f32-by-name-rhs-NK"],
)
def test_dtypes_and_preferred_element_type(dtype: Any, preferred: Any, transpose: bool) -> None:
    check(ROUTINGS[6], SMALL, dtype, transpose=transpose, preferred=preferred)


def test_preferred_element_type_defaults_to_the_input_dtype_in_the_cache_key() -> None:
    lhs, rhs, sizes = inputs(UNEVEN, jnp.bfloat16)
    implicit = ejkernel.explain("grouped_matmul", lhs, rhs, sizes)
    explicit = ejkernel.explain(
        "grouped_matmul", lhs, rhs, sizes, preferred_element_type="bfloat16"
    )
    assert implicit.key == explicit.key


def test_one_compiled_function_serves_every_routing() -> None:
    r = ROUTINGS[6]
    lhs, rhs, _ = inputs(r)
    d_out = normal(jax.random.PRNGKey(7), (r.m, r.n))
    traces = []

    def fwd_bwd(fn: Any, sizes: Any) -> Any:
        out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), lhs, rhs)
        return out, vjp(d_out)

    @jax.jit
    def ours(sizes: Any) -> Any:
        traces.append(1)
        return fwd_bwd(lambda x, w, s: ejkernel.grouped_matmul(x, w, s, cfg=SMALL), sizes)

    reference = jax.jit(lambda sizes: fwd_bwd(grouped_matmul_reference, sizes))
    rng = np.random.default_rng(0)
    for trial in range(6):
        # Random routings, some leaving rows unrouted and some empty experts.
        cuts = np.sort(rng.integers(0, r.m + 1, len(r.sizes) - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [r.m - 3 * (trial % 2)]]))
        sizes = jnp.asarray(np.maximum(sizes, 0), jnp.int32)
        assert_close(ours(sizes), reference(sizes), name=f"routing {np.asarray(sizes)}")
    assert len(traces) == 1


def test_vmap_over_tokens_and_over_routings() -> None:
    r = UNEVEN
    lhs, rhs, sizes = inputs(r)
    lhs2 = jnp.stack([lhs, -2.0 * lhs])
    sizes2 = jnp.stack([sizes, jnp.asarray([0, 37, 0, 0, 0], jnp.int32)])

    def loss(fn: Any, lhs: Any, rhs: Any, sizes: Any) -> Any:
        return jnp.sum(jnp.sin(fn(lhs, rhs, sizes)))

    ours = lambda x, w, s: ejkernel.grouped_matmul(x, w, s, cfg=SMALL)
    grad = lambda fn: jax.value_and_grad(lambda x, w, s: loss(fn, x, w, s), argnums=(0, 1))
    batched_lhs = jax.jit(jax.vmap(grad(ours), in_axes=(0, None, None)))(lhs2, rhs, sizes)
    expected = jax.jit(jax.vmap(grad(grouped_matmul_reference), in_axes=(0, None, None)))(
        lhs2, rhs, sizes
    )
    assert_close(batched_lhs, expected)
    batched_routing = jax.jit(jax.vmap(grad(ours), in_axes=(None, None, 0)))(lhs, rhs, sizes2)
    expected = jax.jit(jax.vmap(grad(grouped_matmul_reference), in_axes=(None, None, 0)))(
        lhs, rhs, sizes2
    )
    assert_close(batched_routing, expected)


def test_every_tile_size_agrees_on_random_routings() -> None:
    # Many experts on few rows: most tiles straddle several groups.
    r = Routing(name="many-experts", sizes=(0,) * 16, m=45, k=24, n=16)
    lhs, rhs, _ = inputs(r)
    rng = np.random.default_rng(1)
    reference = jax.jit(grouped_matmul_reference)
    for block in (1, 4, 16):
        fn = jax.jit(
            functools.partial(ejkernel.grouped_matmul, cfg=GroupedMatmulConfig(block_m=block))
        )
        for _ in range(4):
            sizes = jnp.asarray(
                rng.multinomial(r.m - int(rng.integers(0, 5)), np.ones(16) / 16), jnp.int32
            )
            assert_close(
                fn(lhs, rhs, sizes),
                reference(lhs, rhs, sizes),
                name=f"block {block}",
            )


def test_explain_reports_the_xla_heuristic_and_an_override() -> None:
    lhs, rhs, sizes = inputs(UNEVEN)
    sel = ejkernel.explain("grouped_matmul", lhs, rhs, sizes)
    assert sel.platform == "xla"
    assert sel.source == "heuristic"
    assert isinstance(sel.config, GroupedMatmulConfig) and sel.config.block_m is not None
    assert ejkernel.explain("grouped_matmul", lhs, rhs, sizes, cfg=SMALL).config == SMALL


def test_a_concrete_call_runs_outside_any_trace_also_as_a_kernel_class() -> None:
    from ejkernel.modules import GroupedMatmul, create_default_executor

    lhs, rhs, sizes = inputs(UNEVEN)
    expected = grouped_matmul_reference(lhs, rhs, sizes)
    assert_close(ejkernel.grouped_matmul(lhs, rhs, sizes), expected)
    executor = create_default_executor()
    assert_close(executor(GroupedMatmul(), lhs, rhs, sizes, transpose_rhs=False), expected)


def _errors() -> list[tuple[str, dict[str, Any], type, str]]:
    lhs, rhs, sizes = inputs(UNEVEN)
    return [
        (
            "lhs-3d",
            {"lhs": lhs[None]},
            ValueError,
            "`lhs` must be [M, K]; got lhs.shape=(1, 37, 80)",
        ),
        ("rhs-2d", {"rhs": rhs[0]}, ValueError, "`rhs` must be [G, K, N]; got rhs.shape=(80, 48)"),
        (
            "rhs-wrong-K",
            {"rhs": rhs[:, :79]},
            ValueError,
            "`rhs` must be [G, K, N] with K = lhs.shape[1] = 80",
        ),
        (
            "transposed-rhs-wrong-K",
            {"transpose_rhs": True},
            ValueError,
            "`rhs` must be [G, N, K] with K",
        ),
        (
            "sizes-wrong-G",
            {"group_sizes": sizes[:4]},
            ValueError,
            "`group_sizes` must be [G] with G = rhs.shape[0] = 5",
        ),
        (
            "sizes-float",
            {"group_sizes": sizes.astype(jnp.float32)},
            TypeError,
            "`group_sizes` must be an integer array",
        ),
        (
            "lhs-int",
            {"lhs": jnp.ones((37, 80), jnp.int32)},
            TypeError,
            "`lhs` must be a floating array",
        ),
        (
            "dtype-mismatch",
            {"rhs": rhs.astype(jnp.bfloat16)},
            TypeError,
            "`lhs` and `rhs` must share one dtype",
        ),
        (
            "preferred-int",
            {"preferred_element_type": jnp.int32},
            TypeError,
            "`preferred_element_type` must be a floating dtype",
        ),
        (
            "preferred-garbage",
            {"preferred_element_type": "fp-thirty-two"},
            TypeError,
            "`preferred_element_type`",
        ),
        ("transpose-not-bool", {"transpose_rhs": 1}, TypeError, "`transpose_rhs` must be a bool"),
        ("empty-N", {"rhs": rhs[..., :0]}, ValueError, "non-empty K, N and G"),
        ("lhs-not-array", {"lhs": [[1.0]]}, TypeError, "`lhs` must be an array [M, K]"),
    ]


@pytest.mark.parametrize(
    ("case", "change", "error", "message"), _errors(), ids=[e[0] for e in _errors()]
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    case: str, change: dict[str, Any], error: type, message: str
) -> None:
    lhs, rhs, sizes = inputs(UNEVEN)
    args = {"lhs": lhs, "rhs": rhs, "group_sizes": sizes, **change}
    with pytest.raises(error) as info:
        ejkernel.grouped_matmul(**args)
    assert str(info.value).startswith("grouped_matmul: ")
    assert message in str(info.value)


class _Invocation:
    def __init__(self, m: int, g: int) -> None:
        self.kwargs = {
            "lhs": jax.ShapeDtypeStruct((m, 64), jnp.float32),
            "rhs": jax.ShapeDtypeStruct((g, 64, 32), jnp.float32),
            "group_sizes": jax.ShapeDtypeStruct((g,), jnp.int32),
        }
        self.metadata = {"grad": True}


@pytest.mark.parametrize(
    ("m", "g", "block"),
    [(37, 5, 32), (1024, 8, 64), (4096, 8, 128), (4096, 64, 32), (5, 1, 8)],
    ids=["M37-G5", "M1024-G8", "M4096-G8", "M4096-G64", "M5-G1"],
)
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU tile range")
def test_cpu_tiles_bound_the_straddling_waste(m: int, g: int, block: int) -> None:
    # Largest power of 2 in [32, 128] with (G - 1)·block <= M / 2, never past M's power of 2.
    inv = _Invocation(m, g)
    assert heuristic(inv) == GroupedMatmulConfig(block_m=block)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space))
    assert all(1 <= c.block_m <= max(block, 1 << (m - 1).bit_length()) for c in space)


def test_config_rejects_a_non_positive_tile() -> None:
    with pytest.raises(ValueError, match="block_m"):
        GroupedMatmulConfig(block_m=0)


def test_autotuning_inputs_route_every_row() -> None:
    abstract = {k: v for k, v in _Invocation(37, 5).kwargs.items()}
    abstract.update(preferred_element_type="float32", transpose_rhs=False)
    concrete = grouped_matmul_synthetic(abstract)
    sizes = np.asarray(concrete["group_sizes"])
    assert sizes.dtype == np.int32 and sizes.sum() == 37 and np.all(sizes > 0)
    assert concrete["lhs"].shape == (37, 64) and float(jnp.std(concrete["lhs"])) > 0.5
