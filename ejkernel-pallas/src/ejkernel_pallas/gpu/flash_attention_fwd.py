"""The Mosaic GPU flash-attention forward: one CTA per (head, pair of query tiles, batch), or
persistent (one CTA per SM walking the tiles) for non-causal D 64 with more tiles than SMs.

Each CTA runs three warpgroups: a producer streaming K/V tiles by TMA into a ring of
``stages`` slots, and two consumers of ``bq`` query rows each running ``S = QKᵀ``, the online
softmax (base 2) and ``O += PV`` with FA3's ping-pong between them. When causal, the producer
also cleans the value tiles of the blocks the diagonal cuts (:func:`mg.clean_cut_tiles`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel_pallas import _compat
from ejkernel_pallas.gpu import _mosaic as mg
from ejkernel_pallas.gpu import _problem as pb
from ejkernel_pallas.gpu import _smem as sm
from ejkernel_pallas.gpu._problem import Problem

__all__ = ["fwd_call", "fwd_scratch", "fwd_smem", "persistent"]


#: The causal forward launches its query tiles longest first: the grid runs heads fastest, so
#: each wave holds tiles of one length, and in query order the last wave would hold the longest
#: ones (a long tail on few SMs). About 5 % faster causal forward on an H100; the dQ kernel
#: showed no clear gain from the same order and keeps query order.
LONGEST_FIRST = True


def _q_tile(pr: Problem) -> Any:
    """This forward CTA's pair of query blocks: the grid's ``q_tiles`` index, reversed when
    causal (bottom-right aligned, the last query rows see the most keys)."""
    i = lax.axis_index("q_tiles")
    if pr.causal and LONGEST_FIRST:
        return jnp.int32(pr.sq // (2 * pr.bq) - 1) - i
    return i


def fwd_scratch(pr: Problem) -> list[Any]:
    """The forward's shared memory (:mod:`._smem`): its buffers (Q and O, shared or separate
    for the persistent kernel; the K and V ring of ``stages`` slots of ``bk`` rows; the
    logsumexp rows per consumer), then its barriers: K landed, V landed (for the consumers),
    Q landed (per consumer), K slot free, V slot free, and when causal V copied (for the
    producer, which cleans the tile before it signals V landed)."""
    q = sm.Buffer((2, pr.bq, pr.d), pr.dtype)  # per consumer
    ring = sm.Buffer((pr.stages, pr.bk, pr.d), pr.dtype)
    lse = sm.Buffer((2, pr.bq), jnp.float32, tiled=False)
    buffers = (q, q, ring, ring, lse) if persistent(pr) else (q, ring, ring, lse)
    return [
        buffers,
        sm.Barriers(pr.stages),
        sm.Barriers(pr.stages),
        sm.Barriers(2),
        sm.Barriers(pr.stages, num_arrivals=2),
        sm.Barriers(pr.stages, num_arrivals=2),
        *([sm.Barriers(pr.stages)] if pr.causal else []),
    ]


def fwd_smem(pr: Problem) -> int:
    """Bytes of shared memory the forward kernel of ``pr`` allocates."""
    return sm.nbytes(fwd_scratch(pr))


def persistent(pr: Problem) -> bool:
    """Whether the forward of ``pr`` runs the persistent kernel: non-causal, no tail, a head
    dim of :data:`PERSISTENT_FORWARD_HEAD_DIMS` and more tiles than SMs."""
    return (
        pr.d in PERSISTENT_FORWARD_HEAD_DIMS
        and not pr.causal
        and not pr.tail
        and pr.fwd_tiles > _sm_count(pr)
    )


def _fwd_step(
    pr: Problem,
    carry: tuple[Any, Any, Any],
    *,
    step: Any,
    end: Any,
    q_smem: Any,
    ring: tuple[Any, ...],
    issued: Callable[[], None],
    wait_other: Callable[[], None],
    mask: Callable[[Any], Any] | None = None,
    rows: int | None = None,
) -> tuple[Any, Any, Any]:
    """One kv block of one consumer: ``S = Q·Kᵀ``, the online softmax, ``acc += P·V``.

    ``step`` is the block's position in the ring's stream and ``end`` where the stream stops
    (the K of ``step + 1`` is awaited when it exists); ``ring`` holds the K and V slots with
    their landed and free barriers; ``mask`` sets hidden scores to -inf (a partially visible
    block: its value tile is read through ``finite_or_zero`` too); ``rows`` (default
    ``bk``) is how many leading rows of the slots the block fills (a tail step's pb.TAIL_ROWS).
    The value tile of a masked block arrives clean (:func:`mg.clean_cut_tiles`)."""
    pl, plgpu = _compat.pl, _compat.plgpu()
    k_smem, v_smem, k_landed, v_landed, k_free, v_free = ring
    acc, m, denom = carry
    slot = lax.rem(step, jnp.int32(pr.stages))
    k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
    rows = rows or pr.bk
    if rows != pr.bk:
        part = pl.ds(step * 0, rows)  # a traced start: see mma_acc in _mosaic
        k_tile, v_tile = k_smem.at[slot, part], v_smem.at[slot, part]
    s = mg.mma(pr, q_smem, k_tile, (pr.bq, rows), transpose_b=True, after_issue=issued)
    plgpu.barrier_arrive(k_free.at[slot])
    # The softmax scale (base 2) folds into the exponent's argument: one FMA a logit. The
    # running maximum is max(s) · scale only for a positive scale; otherwise scale first.
    scale = pr.scale * mg.LOG2E
    if pr.scale <= 0:
        s, scale = s * scale, 1.0
    if mask is not None:
        s = mask(s)
    m_new = jnp.maximum(m, s.max(axis=1) * scale)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    denom = denom * alpha + p.sum(axis=1)
    p16 = p.astype(pr.dtype)
    # Pin the order: the softmax finishes before the barriers below.
    acc, p16 = lax.optimization_barrier((acc, p16))
    denom, m_new = lax.optimization_barrier((denom, m_new))
    plgpu.barrier_wait(v_landed.at[slot])
    wait_other()
    nxt = step + 1

    def wait_next_k() -> None:
        @pl.when(nxt < end)
        def _():
            plgpu.barrier_wait(k_landed.at[lax.rem(nxt, pr.stages)])

    # D 128: wait for the next K tile while P·V runs; at D 64 P·V is too short to hide the
    # wait, which is faster after it.
    if pr.d >= 128:
        acc = mg.mma_acc(pr, acc, p16, v_tile, after_issue=wait_next_k)
    else:
        acc = mg.mma_acc(pr, acc, p16, v_tile)
        wait_next_k()
    plgpu.barrier_arrive(v_free.at[slot])
    return acc, m_new, denom


def fwd_call(q: jax.Array, k: jax.Array, v: jax.Array, pr: Problem) -> tuple[jax.Array, jax.Array]:
    """out [B, Sq, Hq, D] and the base-2 logsumexp [B, Hq, Sq] (float32)."""
    if persistent(pr):
        return _fwd_persistent_call(q, k, v, pr)
    return _fwd_launch(
        pr,
        functools.partial(_flash_attention_fwd_kernel, pr=pr),
        grid=mg.head_grid(pr, "q_tiles", pr.sq // (2 * pr.bq)),
        name="ejkernel_flash_attention_fwd",
    )(q, k, v)


def _fwd_launch(pr: Problem, body: Any, *, grid: dict[str, int], name: str) -> Any:
    """A forward kernel of ``(q, k, v) -> (out, lse)`` with the scratch of :func:`fwd_scratch`
    (Q in and O out share a buffer per consumer, except in the persistent kernel)."""
    out = [
        jax.ShapeDtypeStruct((pr.b, pr.sq, pr.hq, pr.d), pr.dtype),
        jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq), jnp.float32),
    ]
    scratch = sm.build(pr, fwd_scratch(pr))
    return mg.launch(pr, body, out=out, scratch=scratch, grid=grid, name=name)


def _flash_attention_fwd_kernel(
    q_ref, k_ref, v_ref, out_ref, lse_ref, smem, *barriers, pr: Problem
):
    pl, plgpu = _compat.pl, _compat.plgpu()
    qo_smem2, k_smem, v_smem, lse_smem2 = smem
    k_landed, v_landed, q_landed, k_free, v_free, *v_copied = barriers  # V copied: causal
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile_q0 = _q_tile(pr) * (2 * pr.bq)
    cta_steps = pr.kv_steps(tile_q0 + pr.bq)  # the second consumer's rows see the most
    bq, bk, d = pr.bq, pr.bk, pr.d

    # FA3's ping-pong on two hardware named barriers: a consumer signals the other once its
    # Q·Kᵀ is issued, and issues its P·V only after the other's Q·Kᵀ is, so one consumer's
    # softmax runs under the other's matmuls. Strictly alternating, balanced at the ends.
    issued = functools.partial(mg.schedule_barrier, pr, wg, "arrive")
    wait_other = functools.partial(mg.schedule_barrier, pr, wg, "sync")

    @mg.consumers(wg)
    def _consumer():
        q0 = tile_q0 + wg * bq
        steps, full = pr.kv_blocks(q0)
        mg.copy_own(wg, (q_ref.at[b, pl.ds(q0, bq), h], qo_smem2, q_landed))
        qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        m = mg.layout(pr, jnp.full((bq,), mg.M_INIT, jnp.float32), "WGMMA", reduce=1)
        denom = mg.layout(pr, jnp.full((bq,), 0.0, jnp.float32), "WGMMA", reduce=1)
        acc = mg.layout(pr, jnp.full((bq, d), 0.0, jnp.float32), "WGMMA")

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_landed.at[0])

        pl.when(wg == 1)(wait_other)

        ring = (k_smem, v_smem, k_landed, v_landed, k_free, v_free)

        def causal_mask(j: Any, s: Any) -> Any:
            return jnp.where(mg.causal_visible(pr, (bq, bk), q0, j * bk), s, -jnp.inf)

        def step(j, carry, masked: bool, rows: int | None = None):
            mask = functools.partial(causal_mask, j) if masked else None
            return _fwd_step(
                pr,
                carry,
                step=j,
                end=steps,
                q_smem=qo_smem,
                ring=ring,
                issued=issued,
                wait_other=wait_other,
                mask=mask,
                rows=rows,
            )

        carry = (acc, m, denom)
        carry = lax.fori_loop(0, full - pr.tail, functools.partial(step, masked=False), carry)
        if pr.tail:  # non-causal: full == steps == nk
            tail_step = functools.partial(step, masked=False, rows=pb.TAIL_ROWS)
            carry = lax.fori_loop(full - pr.tail, full, tail_step, carry)
        if pr.causal:
            carry = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)

            def release(j, _):
                # Slots this consumer's rows never see: hand them back in step with the other.
                slot = lax.rem(j, jnp.int32(pr.stages))
                plgpu.barrier_wait(k_landed.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_landed.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                issued()
                wait_other()

            lax.fori_loop(steps, cta_steps, release, None)
        acc, m, denom = carry
        pl.when(wg == 0)(issued)
        empty = denom == 0.0
        l_safe = jnp.where(empty, 1.0, denom)
        acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        qo_smem[...] = acc.astype(pr.dtype)
        lse_smem[...] = jnp.where(empty, mg.EMPTY_ROW_LSE, m + jnp.log2(l_safe))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q0, bq), h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @mg.producer(wg)
    def _producer():
        kv_h = lax.div(h, jnp.int32(pr.group))
        masked_from = pr.kv_full_steps(tile_q0, cta_steps)  # the first consumer's first cut

        def copy(start, n, slot, rows, v_barrier=v_landed):
            src = (b, pl.ds(start, n), kv_h)
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[rows], k_landed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[rows], v_barrier.at[slot])

        def load(j, slot):
            if pr.causal:  # no tail
                pl.when(j < masked_from)(lambda: copy(j * bk, bk, slot, slot))
                pl.when(j >= masked_from)(lambda: copy(j * bk, bk, slot, slot, *v_copied))
                return
            if not pr.tail:
                copy(j * bk, bk, slot, slot)
                return
            wide = pr.wide_steps
            pl.when(j < wide)(lambda: copy(j * bk, bk, slot, slot))
            tail_rows = (slot, pl.ds(j * 0, pb.TAIL_ROWS))
            tail_start = wide * bk + (j - wide) * pb.TAIL_ROWS
            pl.when(j >= wide)(lambda: copy(tail_start, pb.TAIL_ROWS, slot, tail_rows))

        clean = mg.clean_cut_tiles(pr, masked_from, v_smem, v_copied, v_landed)
        mg.produce(pr, cta_steps, load, (k_free, v_free), start=jnp.int32(0), landed=clean)


#: Non-causal forwards at these head dims with more tiles than SMs run persistent
#: (:func:`_fwd_persistent_call`); at D 128 the grid launch is faster.
PERSISTENT_FORWARD_HEAD_DIMS = (64,)


def _sm_count(pr: Problem) -> int:
    """CTAs of a persistent launch: the GPU's SMs (3 in interpret mode, to loop over tiles)."""
    if pr.interpret:
        return 3
    return int(getattr(jax.devices()[0], "core_count", 132) or 132)


def _fwd_persistent_call(
    q: jax.Array, k: jax.Array, v: jax.Array, pr: Problem
) -> tuple[jax.Array, jax.Array]:
    """The non-causal forward as a persistent kernel: one CTA per SM walks the (head, query
    tile, batch) tiles ``cta, cta + ctas, …``; its producer streams the K/V tiles of all of them
    through one ring, so the next tile's first loads overlap this tile's epilogue, and each
    consumer loads its next Q before writing its output (separate Q and O buffers)."""
    tiles = pr.fwd_tiles
    ctas = min(_sm_count(pr), tiles)
    return _fwd_launch(
        pr,
        functools.partial(_fwd_persistent_kernel, pr=pr, tiles=tiles, ctas=ctas),
        grid={"cta": ctas},
        name="ejkernel_flash_attention_fwd_persistent",
    )(q, k, v)


def _fwd_persistent_kernel(
    q_ref, k_ref, v_ref, out_ref, lse_ref, smem, *barriers, pr: Problem, tiles: int, ctas: int
):
    pl, plgpu = _compat.pl, _compat.plgpu()
    q_smem2, o_smem2, k_smem, v_smem, lse_smem2 = smem
    k_landed, v_landed, q_landed, k_free, v_free = barriers  # non-causal: no V copied
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    bq, bk, d, nk = pr.bq, pr.bk, pr.d, pr.nk
    q_tiles = pr.sq // (2 * bq)
    mine = lax.div(tiles - cta + (ctas - 1), jnp.int32(ctas))  # tiles this CTA runs

    def tile_of(i: Any) -> tuple[Any, Any, Any]:
        """(batch, head, first query row) of this CTA's i-th tile; heads vary fastest."""
        t = cta + i * ctas
        h = lax.rem(t, jnp.int32(pr.hq))
        rest = lax.div(t, jnp.int32(pr.hq))
        return lax.div(rest, jnp.int32(q_tiles)), h, lax.rem(rest, jnp.int32(q_tiles)) * (2 * bq)

    issued = functools.partial(mg.schedule_barrier, pr, wg, "arrive")
    wait_other = functools.partial(mg.schedule_barrier, pr, wg, "sync")

    @mg.consumers(wg)
    def _consumer():
        q_smem, o_smem, lse_smem = q_smem2.at[wg], o_smem2.at[wg], lse_smem2.at[wg]

        def load_q(i: Any) -> None:
            b, h, tile_q0 = tile_of(i)
            rows = (b, pl.ds(tile_q0 + wg * bq, bq), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_landed.at[wg])

        load_q(jnp.int32(0))
        plgpu.barrier_wait(k_landed.at[0])

        def tile(i, _):
            b, h, tile_q0 = tile_of(i)
            q0 = tile_q0 + wg * bq
            first = i * nk  # global step of this tile's first kv block
            plgpu.barrier_wait(q_landed.at[wg])
            m = mg.layout(pr, jnp.full((bq,), mg.M_INIT, jnp.float32), "WGMMA", reduce=1)
            denom = mg.layout(pr, jnp.full((bq,), 0.0, jnp.float32), "WGMMA", reduce=1)
            acc = mg.layout(pr, jnp.full((bq, d), 0.0, jnp.float32), "WGMMA")
            pl.when(wg == 1)(wait_other)

            def step(j, carry):  # the last one awaits the next tile's first K
                return _fwd_step(
                    pr,
                    carry,
                    step=first + j,
                    end=mine * nk,
                    q_smem=q_smem,
                    ring=(k_smem, v_smem, k_landed, v_landed, k_free, v_free),
                    issued=issued,
                    wait_other=wait_other,
                )

            acc, m, denom = lax.fori_loop(0, nk, step, (acc, m, denom))
            pl.when(i + 1 < mine)(functools.partial(load_q, i + 1))  # Q is read: refill it
            pl.when(wg == 0)(issued)
            l_safe = jnp.where(denom == 0.0, 1.0, denom)
            acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's output
            o_smem[...] = acc.astype(pr.dtype)
            lse_smem[...] = m + jnp.log2(l_safe)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, pl.ds(q0, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)])

        lax.fori_loop(0, mine, tile, None)
        plgpu.wait_smem_to_gmem(0)

    @mg.producer(wg)
    def _producer():
        def load(g, slot):
            b, h, _ = tile_of(lax.div(g, jnp.int32(nk)))
            rows = (b, pl.ds(lax.rem(g, jnp.int32(nk)) * bk, bk), lax.div(h, jnp.int32(pr.group)))
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_landed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_landed.at[slot])

        mg.produce(pr, mine * nk, load, (k_free, v_free), start=jnp.int32(0))
