"""Mosaic GPU building blocks of the flash-attention kernels: warpgroup matmuls, layouts,
shared-memory tiles, the consumers' named-barrier ping-pong, the launch and the producer loop.

In interpret mode (``pr.interpret``) every helper falls back to plain JAX on the same tiles: the
matmuls become ``jnp.dot`` (the interpreter does not model WGMMA accumulators) and the
ping-pong barriers are skipped (they only order work).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import visible
from ejkernel_pallas import _compat
from ejkernel_pallas.gpu._problem import Problem

LOG2E = math.log2(math.e)
#: Initial running maximum (base-2 logits): finite, so ``exp2(m_old - m_new)`` is never NaN.
M_INIT = -1e30
#: Base-2 logsumexp of a row with no visible key: ``exp2(s - it)`` is 0.
EMPTY_ROW_LSE = 1e30
#: Registers per thread of consumer and producer warpgroups (FA3's split of the 64K file).
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


def _value(x: Any, transpose: bool = False) -> Any:
    v = x[...] if _compat.is_ref(x) else x
    return v.T if transpose else v


def _issue(
    pr: Problem,
    a: Any,
    b: Any,
    acc_ref: Any,
    *,
    transpose_b: bool,
    after_issue: Callable[[], None] | None,
) -> Any:
    """Start ``acc_ref += a @ b`` (``b`` a shared-memory ref, transposed when asked) as a
    wgmma, and run ``after_issue`` while it is in flight; in interpret mode return ``a @ b``."""
    out = None
    if pr.interpret:
        out = jnp.dot(_value(a), _value(b, transpose_b), preferred_element_type=jnp.float32)
    else:
        _compat.plgpu().wgmma(acc_ref, a, _compat.transpose_ref(b, (1, 0)) if transpose_b else b)
    if after_issue is not None:
        after_issue()
    return out


def mma(
    pr: Problem,
    a: Any,
    b: Any,
    shape: tuple[int, int],
    *,
    transpose_b: bool = False,
    after_issue: Callable[[], None] | None = None,
) -> Any:
    """``a @ b`` (``b`` a shared-memory ref, transposed when asked) in float32 registers."""
    issue = functools.partial(_issue, pr, a, b, transpose_b=transpose_b, after_issue=after_issue)
    if pr.interpret:
        return issue(None)

    def body(acc_ref: Any) -> Any:
        issue(acc_ref)
        return acc_ref[...]

    return _compat.pl.run_scoped(body, _compat.gpu_accumulator(shape, jnp.float32))


def mma_acc(
    pr: Problem,
    acc: Any,
    a: Any,
    b: Any,
    *,
    transpose_b: bool = False,
    after_issue: Callable[[], None] | None = None,
) -> Any:
    """``acc + a @ b``, accumulating in the wgmma accumulator on the GPU; ``after_issue`` runs
    while the matmul is in flight. Refs it reads (``b`` too) must be indexed by traced values:
    with jax 0.11, a constant index there fails to lower ("Shaped arrays must be represented by
    ir.Values")."""
    issue = functools.partial(_issue, pr, a, b, transpose_b=transpose_b, after_issue=after_issue)
    if pr.interpret:
        return acc + issue(None)
    return _compat.pl.run_state(issue)(_compat.gpu_accumulator_init(acc))


def consumers(wg: Any) -> Callable[[Callable[[], None]], None]:
    """Decorator: run the body on the two consumer warpgroups (``wg`` 0 and 1), with the
    larger share of the register file."""

    def run(body: Callable[[], None]) -> None:
        @_compat.pl.when(wg < 2)
        def _() -> None:
            _compat.plgpu().set_max_registers(CONSUMER_REGISTERS, action="increase")
            body()

    return run


def producer(wg: Any) -> Callable[[Callable[[], None]], None]:
    """Decorator: run the body on the producer warpgroup (``wg`` 2), with few registers."""

    def run(body: Callable[[], None]) -> None:
        @_compat.pl.when(wg == 2)
        def _() -> None:
            _compat.plgpu().set_max_registers(PRODUCER_REGISTERS, action="decrease")
            body()

    return run


def copy_own(wg: Any, *copies: tuple[Any, Any, Any]) -> None:
    """Load consumer ``wg``'s own tiles: for each ``(source, smem, landed)`` copy the
    global-memory ``source`` into ``smem.at[wg]`` signalling ``landed.at[wg]``, all copies in
    flight together, then wait for every one."""
    plgpu = _compat.plgpu()
    for source, smem, landed in copies:
        plgpu.copy_gmem_to_smem(source, smem.at[wg], landed.at[wg])
    for _, _, landed in copies:
        plgpu.barrier_wait(landed.at[wg])


#: Named barriers of the consumers' ping-pong (Mosaic GPU itself uses the low IDs).
SCHEDULE_BARRIERS = (8, 9)


def schedule_barrier(pr: Problem, wg: Any, operation: str) -> None:
    """Consumer ``wg`` (0 or 1) arrives at the other's named barrier (``"arrive"``) or waits
    at its own for the other's arrival (``"sync"``); 256 threads each. A no-op in interpret
    mode, which runs the warpgroups without a schedule to order."""
    if pr.interpret:
        return
    pl = _compat.pl
    for me, mine in enumerate(SCHEDULE_BARRIERS):
        theirs = SCHEDULE_BARRIERS[1 - me]
        target = theirs if operation == "arrive" else mine
        pl.when(wg == me)(functools.partial(_compat.gpu_named_barrier, operation, target, 2 * 128))


def layout(pr: Problem, x: Any, layout: str, reduce: int | None = None) -> Any:
    if pr.interpret:
        return x
    lay = _compat.gpu_layout(layout)
    return _compat.plgpu().layout_cast(x, lay.reduce(reduce) if reduce is not None else lay)


def load_row_vector(pr: Problem, ref: Any, axis: int) -> Any:
    """A [n] float32 vector from shared memory in the WGMMA layout reduced over ``axis``."""
    if pr.interpret:
        return ref[...]
    return _compat.gpu_load(ref, layout=_compat.gpu_layout("WGMMA").reduce(axis))


def iota(pr: Problem, shape: tuple[int, int], dim: int) -> Any:
    if pr.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    plgpu = _compat.plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_compat.gpu_layout("WGMMA"))


def causal_visible(
    pr: Problem, shape: tuple[int, int], q_start: Any, k_start: Any, *, q_axis: int = 0
) -> Any:
    """Bool ``shape`` tile of :func:`ejkernel.attention_semantics.visible` (causal): axis
    ``q_axis`` holds the queries from row ``q_start``, the other axis the keys from ``k_start``."""
    q_pos = iota(pr, shape, q_axis) + (q_start + pr.offset)
    k_pos = iota(pr, shape, 1 - q_axis) + k_start
    return visible(q_pos, k_pos, causal=True)


def finite_or_zero_smem(pr: Problem, ref: Any, rows: int | None = None) -> None:
    """Rewrite a shared-memory operand tile with its NaN and ±Inf entries as 0
    (:func:`ejkernel.attention_semantics.finite_or_zero` in place), before a matmul reads it
    against probabilities of a partially visible block: ``0 · NaN`` is NaN, so a hidden
    non-finite key or value would otherwise reach the rows that cannot see it. ``rows`` (a
    multiple of 64) passes the tile in slices of that many rows, to hold fewer registers (the
    producer warpgroup's share is small)."""
    pl = _compat.pl
    step = rows or ref.shape[0]
    for r in range(0, ref.shape[0], step):
        # A traced start: see mma_acc.
        part = ref if step == ref.shape[0] else ref.at[pl.ds(lax.axis_index("wg") * 0 + r, step)]
        x = (
            part[...]
            if pr.interpret
            else _compat.gpu_load(part, layout=_compat.gpu_layout("WGMMA"))
        )
        # |x| <= max is False for NaN and ±Inf alike (``isfinite`` has no Mosaic GPU lowering).
        part[...] = jnp.where(jnp.abs(x) <= jnp.finfo(x.dtype).max, x, jnp.zeros((), x.dtype))
    _compat.plgpu().commit_smem()  # the writes, before a wgmma reads the tile


def clean_cut_tiles(
    pr: Problem, masked_from: Any, ring: Any, copied: Sequence[Any], landed: Any
) -> Callable[[Any, Any], None] | None:
    """:func:`produce`'s ``landed`` for a causal kernel (``None`` otherwise): from step
    ``masked_from`` on (the blocks the diagonal cuts, whose tiles were copied signalling
    ``copied[0]``, the producer's own barriers) await the ``ring`` slot's copy, clean it
    (:func:`finite_or_zero_smem`), then signal ``landed`` to the consumers, which read it as
    any other tile. Cleaning in the producer keeps the shared-memory pass off the consumers'
    instruction stream and does it once for both."""
    if not pr.causal:
        return None
    pl, plgpu = _compat.pl, _compat.plgpu()

    def clean(step: Any, slot: Any) -> None:
        @pl.when(step >= masked_from)
        def _() -> None:
            plgpu.barrier_wait(copied[0].at[slot])
            finite_or_zero_smem(pr, ring.at[slot], rows=64)
            plgpu.barrier_arrive(landed.at[slot])

    return clean


def smem(pr: Problem, shape: tuple[int, ...], dtype: Any, tiled: bool = True) -> Any:
    plgpu = _compat.plgpu()
    if not tiled:
        return plgpu.SMEM(shape, dtype)
    swizzle = 128
    transforms = (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def head_grid(pr: Problem, tiles: str, count: int) -> dict[str, int]:
    """The grid of one CTA per (head, tile, batch): heads vary fastest."""
    return {"heads": pr.hq, tiles: count, "batch": pr.b}


def launch(
    pr: Problem, body: Any, *, out: Any, scratch: Any, grid: dict[str, int], name: str
) -> Any:
    """``plgpu.kernel`` of ``body`` with three warpgroups (``wg``) a CTA over ``grid`` (axis
    name to size)."""
    # No cross-warp reduction scratch: every row reduction of a wgmma tile stays in one warp,
    # and the 2 KiB it reserves by default are what two 192-row K/V stages at D 128 lack.
    params = {"approx_math": True, "reduction_scratch_bytes": 0}
    return _compat.gpu_kernel(
        body,
        out=out,
        scratch=scratch,
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        num_threads=3,
        thread_name="wg",
        compiler_params=_compat.gpu_compiler_params(**params),
        name=name,
        interpret=pr.interpret,
    )


def release_slots(
    pr: Problem, begin: Any, end: Any, landed: tuple[Any, ...], free: Any, *, origin: Any = 0
) -> None:
    """Steps ``[begin, end)`` this consumer skips: wait for their data (keeping every
    barrier's phase in step with the producer) and hand the slot back. ``origin`` is the step
    the producer loads into slot 0 (its ``start``): step ``j`` sits in slot
    ``(j - origin) % stages``, as the consumer's own steps read it."""
    plgpu = _compat.plgpu()

    def release(j, _):
        slot = lax.rem(j - origin, jnp.int32(pr.stages))
        for barrier in landed:
            plgpu.barrier_wait(barrier.at[slot])
        plgpu.barrier_arrive(free.at[slot])

    lax.fori_loop(begin, end, release, None)


def produce(
    pr: Problem,
    end: Any,
    load: Callable[[Any, Any], None],
    free: tuple[Any, ...],
    *,
    start: Any,
    landed: Callable[[Any, Any], None] | None = None,
) -> None:
    """Producer loop over steps ``[start, end)``: fill the ring, refill each slot once both
    consumers released it (every barrier of ``free``), and at the end wait for the last
    releases, so the producer observes every phase of the barriers it waits on.
    ``load(step, slot)`` issues the copies of one step; ``landed(step, slot)``, when given,
    runs after them (after the whole first fill), before the producer waits for that slot's
    release: work on a tile the producer itself awaits."""
    pl, plgpu = _compat.pl, _compat.plgpu()
    stages = jnp.int32(pr.stages)
    for i in range(pr.stages):
        pl.when(start + i < end)(functools.partial(load, start + i, i))
    if landed is not None:
        for i in range(pr.stages):
            pl.when(start + i < end)(functools.partial(landed, start + i, i))

    def wait_free(t: Any) -> None:
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(t, stages)])

    @pl.loop(0, jnp.maximum(end - start - pr.stages, 0))
    def _(t):
        wait_free(t)
        slot = lax.rem(t, stages)
        load(start + t + pr.stages, slot)
        if landed is not None:
            landed(start + t + pr.stages, slot)

    @pl.loop(jnp.maximum(end - start - pr.stages, 0), jnp.maximum(end - start, 0))
    def _(t):
        wait_free(t)
