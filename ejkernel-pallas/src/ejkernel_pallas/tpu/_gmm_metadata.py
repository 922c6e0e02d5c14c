"""The work list of the Pallas TPU grouped matmul: which (row tile, group) pairs a grid visits.

Built with plain ``jnp`` ops from the traced ``group_sizes`` (one compiled kernel serves every
routing) and handed to the kernels by scalar prefetch (SMEM). Rows ``[0, M)`` (M padded to
whole tiles of ``block_m``) are cut into ``T = M / block_m`` tiles. A group covering rows
``[s, e)`` touches tiles ``s // block_m`` to ``(e - 1) // block_m``; each group boundary splits
at most one tile, so the non-empty pairs number at most ``T + G`` (``G`` groups plus the "tail"
below). Pairs are listed in row order, groups ascending, so

- an output row tile of the forward is visited on consecutive grid steps only (Pallas TPU
  writes an output block back when its index changes, so a tile may not be left and revisited);
- an output group of the transposed product (``tgmm``) is visited on consecutive steps only.

Two lists:

- :func:`row_plan` (forward and ``d_lhs``): the ``G`` groups plus a tail pseudo-group ``G``
  owning the rows past ``sum(group_sizes)`` (clipped to M), so every row tile is visited and
  every output row written (the tail writes zeros). Empty groups are skipped.
- :func:`group_plan` (``tgmm``): the ``G`` groups, an empty one visited once (its output block
  must still be written, with zeros); the tail is skipped.

The grid has a static length ``W`` (the bound); steps past the pairs that exist repeat the last
pair with ``valid = 0``: same block indices, so no DMA and no write-back, and no compute.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Plan(NamedTuple):
    """Scalar-prefetch arrays (int32) of one launch.

    Attributes:
        offsets: ``[G + 2]``: group ``g`` owns rows ``[offsets[g], offsets[g + 1])``; group
            ``G`` is the tail (rows past the total, up to the padded M).
        group: ``[W]``: the group of each grid step.
        tile: ``[W]``: the row tile of each grid step.
        valid: ``[W]``: 1 on steps that compute, 0 on the filler past the pairs.
    """

    offsets: jax.Array
    group: jax.Array
    tile: jax.Array
    valid: jax.Array


def row_steps(num_tiles: int, num_groups: int) -> int:
    """Grid length of :func:`row_plan` and :func:`group_plan`: ``T + G`` pairs at most."""
    return num_tiles + num_groups


def _offsets(group_sizes: jax.Array, m: int, m_padded: int) -> jax.Array:
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    zero = jnp.zeros((1,), jnp.int32)
    return jnp.concatenate([zero, ends, jnp.full((1,), m_padded, jnp.int32)])


def _plan(group_sizes: jax.Array, *, m: int, block_m: int, tail: bool, visit_empty: bool) -> Plan:
    num_tiles = -(-m // block_m)
    m_padded = num_tiles * block_m
    num_groups = group_sizes.shape[0]
    offsets = _offsets(group_sizes, m, m_padded)
    starts, ends = offsets[:-1], offsets[1:]  # G + 1 groups, the tail last
    if not tail:
        starts, ends = starts[:-1], ends[:-1]
    first = jnp.minimum(starts // block_m, num_tiles - 1)
    last = (jnp.maximum(ends, 1) - 1) // block_m
    nonempty = ends > starts
    counts = jnp.where(nonempty, last - first + 1, 1 if visit_empty else 0)
    steps = row_steps(num_tiles, num_groups)
    pairs_end = jnp.cumsum(counts)
    pairs_start = pairs_end - counts
    total = pairs_end[-1]
    step = jnp.arange(steps, dtype=jnp.int32)
    pair = jnp.minimum(step, jnp.maximum(total - 1, 0))  # the filler repeats the last pair
    group = jnp.minimum(jnp.searchsorted(pairs_end, pair, side="right"), counts.shape[0] - 1)
    tile = jnp.clip(first[group] + pair - pairs_start[group], 0, num_tiles - 1)
    return Plan(
        offsets=offsets,
        group=group.astype(jnp.int32),
        tile=tile.astype(jnp.int32),
        valid=(step < total).astype(jnp.int32),
    )


def row_plan(group_sizes: jax.Array, *, m: int, block_m: int) -> Plan:
    """Pairs for the forward: every row tile visited, the tail group ``G`` writing zeros."""
    return _plan(group_sizes, m=m, block_m=block_m, tail=True, visit_empty=False)


def group_plan(group_sizes: jax.Array, *, m: int, block_m: int) -> Plan:
    """Pairs for ``tgmm``: every group visited (an empty one once), the tail skipped."""
    return _plan(group_sizes, m=m, block_m=block_m, tail=False, visit_empty=True)
