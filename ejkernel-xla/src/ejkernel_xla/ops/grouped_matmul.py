"""grouped_matmul on XLA: row tiles, one loop step per (tile, group) pair.

The layout is that of the grouped-matmul kernels of MegaBlocks (Gale et al., 2022) and JAX's
Pallas "megablox": cut the rows of ``lhs`` into tiles of ``block_m``; a tile lies in one group or straddles a few, so
the non-empty (tile, group) pairs number at most ``num_tiles + G - 1`` whatever the routing
(each group boundary splits at most one tile). From the traced ``group_sizes`` we list those
pairs in row order (per group: its first and last tile, then an exclusive cumsum of tile
counts, then a ``searchsorted`` from pair index to group) and run a ``fori_loop`` over the
pairs that exist (a traced trip count, so missing pairs cost nothing):

- forward, and ``d_lhs = d_out · rhs[g]ᵀ``: step (t, g) multiplies tile t by ``rhs[g]`` (a
  ``[block_m, K] × [K, N]`` dot, float32 accumulation) and writes the rows of tile t that
  belong to g into the output tile (a select: every row has one group, so nothing is added).
  Rows in no group are never written and stay zero.
- ``d_rhs[g] = lhs_gᵀ · d_out_g`` (the "transposed grouped matmul"): step (t, g) masks tile t
  to g's rows and adds ``tileᵀ · d_out_tile`` to ``d_rhs[g]``, carried in float32.

Work is ``2·(M + (G - 1)·block_m)·K·N`` flops at most, against the ``2·G·M·K·N`` of
``lax.ragged_dot``, which jax 0.10 expands on CPU into one dense dot over a G-fold masked copy
of ``lhs`` (on the H100, jax 0.11, its speed of about the dense rate over G says the same); it
also has no ``vmap`` rule. This loop is several times faster than ``ragged_dot`` on the CPU
and on an H100, and within a small factor of one dense matmul of the same size; on a GPU its
per-step launches dominate when groups are small, which is what a Triton/Pallas grouped matmul
is for (figures: ``benchmarks/RESULTS.md``, "Other XLA ops").

Smaller tiles waste less on tiles that straddle groups; larger ones run fewer, faster steps.
:func:`heuristic` picks the largest power of two in the backend's range whose worst-case
waste ``(G - 1)·block_m`` stays under M / 2. The ranges: CPU 32-128 (there the rule's tile
was the best or near it on the shapes timed), GPU 256-1024 (per-step overhead dominates, so
the floor is high); a TPU takes the GPU range.

Accumulation is float32; matmul inputs keep the input dtype (``d_out`` is cast to it in the
backward). It declines nothing (no ``supports``): this backend serves every valid call.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.specs.grouped_matmul import define_grouped_matmul_vjp
from ejkernel_xla.ops._tuning import backend, distinct, pow2_ceil

__all__ = [
    "GroupedMatmulConfig",
    "config_space",
    "grouped_matmul_xla",
    "heuristic",
]

#: (smallest, largest) tile the heuristic picks per backend, unless M itself is smaller. Below
#: the floor the per-step costs dominate: on CPU the [K, N] read-modify-write of ``d_rhs[g]``
#: in the backward, on GPU the launches of each loop step.
_BLOCK_M_RANGE: dict[str, tuple[int, int]] = {
    "cpu": (32, 128),
    "gpu": (256, 1024),
    "tpu": (256, 1024),
}
#: Tile sizes :func:`config_space` offers (those above the padded M are dropped).
_TUNING_BLOCKS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)


@attrs.frozen(kw_only=True)
class GroupedMatmulConfig:
    """Tunables of the XLA grouped matmul.

    Attributes:
        block_m: rows of ``lhs`` per tile, in the forward and both backward products; ``None``
            takes :func:`heuristic`'s choice for the call's shapes.
    """

    block_m: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )


def heuristic(inv: Any) -> GroupedMatmulConfig:
    """The largest power-of-two tile in the backend's range whose worst-case straddling waste
    ``(G - 1)·block_m`` stays under M / 2 (the range's floor when none does)."""
    m, num_groups = _sizes(inv)
    return GroupedMatmulConfig(block_m=_default_block_m(m, num_groups))


def config_space(inv: Any) -> list[GroupedMatmulConfig]:
    """The heuristic's tile, then every tuning tile no longer than M rounded up to a power of 2."""
    m, _ = _sizes(inv)
    tuned = (GroupedMatmulConfig(block_m=b) for b in _TUNING_BLOCKS if b <= pow2_ceil(m))
    return distinct([heuristic(inv), *tuned])


def grouped_matmul_xla(*, cfg: GroupedMatmulConfig | None = None, **args: Any) -> jax.Array:
    """Grouped matmul by row tiles: the op's arguments
    (:func:`ejkernel.specs.grouped_matmul.grouped_matmul`, validated by the core) as keywords,
    and the tile size ``cfg`` (``None``: the heuristic's).

    Returns:
        [M, N] in ``preferred_element_type``; rows past ``sum(group_sizes)`` are zeros.
    """
    lhs, rhs = args["lhs"], args["rhs"]
    dtype = args.get("preferred_element_type")
    out_dtype = lhs.dtype if dtype is None else jnp.dtype(dtype)
    return _gmm(
        lhs,
        rhs,
        args["group_sizes"],
        block_m=_block_m(cfg, lhs.shape[0], rhs.shape[0]),
        contract_rhs_dim=1 if args.get("transpose_rhs") else 0,
        out_dtype=out_dtype.name,
    )


def _grouped_matmul_bwd(
    d_out: jax.Array, cfg: GroupedMatmulConfig | None, args: dict[str, Any]
) -> tuple[jax.Array, jax.Array]:
    """Backward of :func:`grouped_matmul_xla`.

    Returns:
        ``d_lhs``: ``d_out · rhs[g]ᵀ`` per row (a grouped matmul contracting N), zero past the
        total; ``d_rhs``: ``lhs_gᵀ · d_out_g`` per group ([G, N, K] layout with
        ``transpose_rhs``), zero for empty groups. Each in its input's dtype; ``d_out`` arrives
        in ``preferred_element_type``, the matmuls run in the input dtype.
    """
    lhs, rhs, transpose_rhs = args["lhs"], args["rhs"], args["transpose_rhs"]
    d_out = d_out.astype(lhs.dtype)
    sizes = args["group_sizes"]
    block_m = _block_m(cfg, lhs.shape[0], rhs.shape[0])
    # rhs[g] is [K, N] (contract its N, dim 1) or, transposed, [N, K] (contract dim 0).
    d_lhs = _gmm(
        d_out,
        rhs,
        sizes,
        block_m=block_m,
        contract_rhs_dim=0 if transpose_rhs else 1,
        out_dtype=lhs.dtype.name,
    )
    if transpose_rhs:
        d_rhs = _tgmm(d_out, lhs, sizes, block_m=block_m)  # [G, N, K]
    else:
        d_rhs = _tgmm(lhs, d_out, sizes, block_m=block_m)  # [G, K, N]
    return d_lhs, d_rhs.astype(rhs.dtype)


define_grouped_matmul_vjp(grouped_matmul_xla, _grouped_matmul_bwd)


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _sizes(inv: Any) -> tuple[int, int]:
    kwargs = inv.kwargs
    return int(kwargs["lhs"].shape[0]), int(kwargs["rhs"].shape[0])


def _default_block_m(m: int, num_groups: int) -> int:
    """Largest power of 2 in the backend's range with (G - 1)·block_m <= M / 2 (else the floor).

    Never longer than M rounded up to a power of two (one tile then covers every row).
    """
    smallest, block = _BLOCK_M_RANGE[backend(_BLOCK_M_RANGE)]
    while block > smallest and (num_groups - 1) * block > m // 2:
        block //= 2
    return min(block, pow2_ceil(m))


def _block_m(cfg: GroupedMatmulConfig | None, m: int, num_groups: int) -> int:
    if cfg is not None and cfg.block_m is not None:
        return int(cfg.block_m)
    return _default_block_m(m, num_groups)


# --------------------------------------------------------------------------------------------
# The (tile, group) plan
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Plan:
    """Which (tile, group) pairs to visit, in row order; built from traced ``group_sizes``.

    Attributes:
        block_m: rows per tile.
        num_tiles: tiles covering M rows (the last one padded).
        starts: [G] int32, first row of each group, clipped to M.
        ends: [G] int32, one past each group's last row, clipped to M.
        group: [W] int32, W = num_tiles + G - 1: the group of each pair.
        tile: [W] int32: the tile of each pair.
        count: int32 scalar: pairs that exist (the rest of ``group``/``tile`` is filler).
    """

    block_m: int
    num_tiles: int
    starts: jax.Array
    ends: jax.Array
    group: jax.Array
    tile: jax.Array
    count: jax.Array

    @classmethod
    def of(cls, group_sizes: jax.Array, *, m: int, block_m: int) -> _Plan:
        sizes = group_sizes.astype(jnp.int32)
        num_groups = sizes.shape[0]
        num_tiles = -(-m // block_m)
        cumulative = jnp.cumsum(sizes)
        ends = jnp.minimum(cumulative, m)
        starts = jnp.clip(cumulative - sizes, 0, m)
        nonempty = ends > starts
        first_tile = starts // block_m
        last_tile = (ends - 1) // block_m
        tiles_per_group = jnp.where(nonempty, last_tile - first_tile + 1, 0)
        pairs_end = jnp.cumsum(tiles_per_group)  # pairs of groups 0..g
        pairs_start = pairs_end - tiles_per_group
        pair = jnp.arange(num_tiles + num_groups - 1, dtype=jnp.int32)
        group = jnp.minimum(jnp.searchsorted(pairs_end, pair, side="right"), num_groups - 1)
        tile = jnp.clip(first_tile[group] + pair - pairs_start[group], 0, num_tiles - 1)
        return cls(
            block_m=block_m,
            num_tiles=num_tiles,
            starts=starts,
            ends=ends,
            group=group.astype(jnp.int32),
            tile=tile.astype(jnp.int32),
            count=pairs_end[-1],
        )

    def tiled(self, x: jax.Array) -> jax.Array:
        """[M, F] -> [num_tiles, block_m, F], zero-padded."""
        m, f = x.shape
        pad = self.num_tiles * self.block_m - m
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
        return x.reshape(self.num_tiles, self.block_m, f)

    def untiled(self, x: jax.Array, m: int) -> jax.Array:
        """[num_tiles, block_m, F] -> [M, F]."""
        return x.reshape(self.num_tiles * self.block_m, x.shape[-1])[:m]

    def pair(self, i: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Group, tile and row mask ``[block_m]`` (rows of the tile in the group) of pair i."""
        g, t = self.group[i], self.tile[i]
        rows = t * self.block_m + jnp.arange(self.block_m, dtype=jnp.int32)
        return g, t, (rows >= self.starts[g]) & (rows < self.ends[g])


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("block_m", "contract_rhs_dim", "out_dtype"))
def _gmm(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int,
    contract_rhs_dim: int,
    out_dtype: str,
) -> jax.Array:
    """``out[r] = x[r] · w[g]`` for the rows r of each group g, contracting ``w[g]``'s
    ``contract_rhs_dim`` with x's columns; [M, F] x [G, ·, ·] -> [M, N], zeros outside groups."""
    m = x.shape[0]
    plan = _Plan.of(group_sizes, m=m, block_m=block_m)
    n = w.shape[2 - contract_rhs_dim]
    x_tiles = plan.tiled(x)
    acc_dtype = jnp.promote_types(jnp.float32, out_dtype)
    dims = (((1,), (contract_rhs_dim,)), ((), ()))

    def step(i: jax.Array, out: jax.Array) -> jax.Array:
        g, t, in_group = plan.pair(i)
        x_t = lax.dynamic_index_in_dim(x_tiles, t, 0, keepdims=False)
        w_g = lax.dynamic_index_in_dim(w, g, 0, keepdims=False)
        y = lax.dot_general(x_t, w_g, dims, preferred_element_type=acc_dtype).astype(out.dtype)
        old = lax.dynamic_index_in_dim(out, t, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(out, jnp.where(in_group[:, None], y, old), t, 0)

    out = jnp.zeros((plan.num_tiles, plan.block_m, n), out_dtype)
    out = lax.fori_loop(0, plan.count, step, out)
    return plan.untiled(out, m)


@functools.partial(jax.jit, static_argnames=("block_m",))
def _tgmm(a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, block_m: int) -> jax.Array:
    """``out[g] = a_gᵀ · b_g`` over the rows of each group: [M, P] x [M, Q] -> [G, P, Q] f32."""
    plan = _Plan.of(group_sizes, m=a.shape[0], block_m=block_m)
    a_tiles, b_tiles = plan.tiled(a), plan.tiled(b)
    dims = (((0,), (0,)), ((), ()))

    def step(i: jax.Array, acc: jax.Array) -> jax.Array:
        g, t, in_group = plan.pair(i)
        a_t = lax.dynamic_index_in_dim(a_tiles, t, 0, keepdims=False)
        a_t = jnp.where(in_group[:, None], a_t, jnp.zeros((), a_t.dtype))
        b_t = lax.dynamic_index_in_dim(b_tiles, t, 0, keepdims=False)
        part = lax.dot_general(a_t, b_t, dims, preferred_element_type=jnp.float32)
        old = lax.dynamic_index_in_dim(acc, g, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(acc, old + part, g, 0)

    acc = jnp.zeros((group_sizes.shape[0], a.shape[1], b.shape[1]), jnp.float32)
    return lax.fori_loop(0, plan.count, step, acc)
