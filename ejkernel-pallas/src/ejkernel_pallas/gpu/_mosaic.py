"""Mosaic GPU building blocks of the flash-attention kernels: warpgroup matmuls, layouts,
shared-memory tiles, the consumers' named-barrier ping-pong, the launch and the producer loop.

In interpret mode (``pr.interpret``) every helper falls back to plain JAX on the same tiles: the
matmuls become ``jnp.dot`` (the interpreter does not model WGMMA accumulators) and the
ping-pong barriers are skipped (they only order work).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

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
    if pr.interpret:
        out = jnp.dot(_value(a), _value(b, transpose_b), preferred_element_type=jnp.float32)
        if after_issue is not None:
            after_issue()
        return out
    plgpu, pl = _compat.plgpu(), _compat.pl
    b_ref = _compat.transpose_ref(b, (1, 0)) if transpose_b else b

    def body(acc_ref: Any) -> Any:
        plgpu.wgmma(acc_ref, a, b_ref)
        if after_issue is not None:
            after_issue()
        return acc_ref[...]

    return pl.run_scoped(body, _compat.gpu_accumulator(shape, jnp.float32))


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
    if pr.interpret:
        out = acc + jnp.dot(_value(a), _value(b, transpose_b), preferred_element_type=jnp.float32)
        if after_issue is not None:
            after_issue()
        return out
    plgpu, pl = _compat.plgpu(), _compat.pl
    b_ref = _compat.transpose_ref(b, (1, 0)) if transpose_b else b

    def body(acc_ref: Any) -> None:
        plgpu.wgmma(acc_ref, a, b_ref)
        if after_issue is not None:
            after_issue()

    return pl.run_state(body)(_compat.gpu_accumulator_init(acc))


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


def launch(
    pr: Problem,
    body: Any,
    *,
    out: Any,
    scratch: Any,
    grid: tuple[int, ...],
    grid_names: tuple[str, ...],
    name: str,
) -> Any:
    # No cross-warp reduction scratch: every row reduction of a wgmma tile stays in one warp,
    # and the 2 KiB it reserves by default are what two 192-row K/V stages at D 128 lack.
    params = {"approx_math": True, "reduction_scratch_bytes": 0}
    kwargs: dict[str, Any] = {}
    if pr.interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return _compat.gpu_kernel(
        body,
        out=out,
        scratch=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=_compat.gpu_compiler_params(**params),
        name=name,
        **kwargs,
    )


def release_slots(pr: Problem, begin: Any, end: Any, landed: tuple[Any, ...], free: Any) -> None:
    """Steps ``[begin, end)`` this consumer skips: wait for their data (keeping every
    barrier's phase in step with the producer) and hand the slot back."""
    plgpu = _compat.plgpu()

    def release(j, _):
        slot = lax.rem(j, jnp.int32(pr.stages))
        for barrier in landed:
            plgpu.barrier_wait(barrier.at[slot])
        plgpu.barrier_arrive(free.at[slot])

    lax.fori_loop(begin, end, release, None)


def produce(
    pr: Problem, end: Any, load: Callable[[Any, Any], None], free: tuple[Any, ...], *, start: Any
) -> None:
    """Producer loop over steps ``[start, end)``: fill the ring, refill each slot once both
    consumers released it (every barrier of ``free``), and at the end wait for the last
    releases, so the producer observes every phase of the barriers it waits on.
    ``load(step, slot)`` issues the copies of one step."""
    pl, plgpu = _compat.pl, _compat.plgpu()
    stages = jnp.int32(pr.stages)
    for i in range(pr.stages):
        pl.when(start + i < end)(functools.partial(load, start + i, i))

    def wait_free(t: Any) -> None:
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(t, stages)])

    @pl.loop(0, jnp.maximum(end - start - pr.stages, 0))
    def _(t):
        wait_free(t)
        load(start + t + pr.stages, lax.rem(t, stages))

    @pl.loop(jnp.maximum(end - start - pr.stages, 0), jnp.maximum(end - start, 0))
    def _(t):
        wait_free(t)
