"""The Mosaic GPU flash-attention backward: ``dQ`` (consumers own query rows and stream K/V)
and ``dK``/``dV`` (consumers own key rows and stream Q, dO, logsumexp and Δ; causal starts each
consumer at its first visible query block), with the forward's producer/consumer structure.
When causal, the producer of dQ cleans the K tiles of the blocks the diagonal cuts
(:func:`mg.clean_cut_tiles`): ``dS·K`` must not read a hidden non-finite key into a row. dK/dV
needs no cleaning (as the Triton kernels): its own K and V meet the streamed rows only
through ``dS`` and ``P``, zero where hidden. On a cut block the hidden scores are selected
to ``-inf`` after the logsumexp is subtracted (``P`` is then exactly 0 there, whatever the
row's logsumexp) and ``dS`` is selected to 0 where ``P`` is 0: that predicate is at hand,
where the visibility tile would stay live across two matmuls (about 2 % of the D 64 causal
backward, benchmarks/RESULTS.md). A visible entry whose ``P`` underflows to 0 has ``dS`` 0
either way, unless its row is already non-finite.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import hide
from ejkernel_pallas import _compat
from ejkernel_pallas.gpu import _mosaic as mg
from ejkernel_pallas.gpu import _smem as sm
from ejkernel_pallas.gpu._problem import Problem

__all__ = ["bwd_smem", "dkv_call", "dkv_scratch", "dq_call", "dq_scratch"]


def dq_scratch(pr: Problem) -> list[Any]:
    """The dQ kernel's shared memory (:mod:`._smem`): per consumer Q (then dQ out), dO,
    logsumexp and Δ; the K and V ring; then its barriers (when causal, K copied last)."""
    rows = sm.Buffer((2, pr.bq, pr.d), pr.dtype)
    vector = sm.Buffer((2, pr.bq), jnp.float32, tiled=False)
    ring = sm.Buffer((pr.stages, pr.bk, pr.d), pr.dtype)
    return [
        (rows, rows, vector, vector, ring, ring),
        sm.Barriers(2),  # Q, dO, lse, delta landed (one barrier each)
        sm.Barriers(2),
        sm.Barriers(2),
        sm.Barriers(2),
        sm.Barriers(pr.stages),  # K landed
        sm.Barriers(pr.stages),  # V landed
        sm.Barriers(pr.stages, num_arrivals=2),  # K/V slot free
        *([sm.Barriers(pr.stages)] if pr.causal else []),  # K copied, before the cleaning
    ]


def dkv_scratch(pr: Problem) -> list[Any]:
    """The dK/dV kernel's shared memory (:mod:`._smem`): per consumer K (then dK out) and V
    (then dV out); the Q, dO, logsumexp and Δ rings; under GQA the float32 outputs; then its
    barriers."""
    rows = sm.Buffer((2, pr.bk, pr.d), pr.dtype)
    ring = sm.Buffer((pr.stages, pr.bq, pr.d), pr.dtype)
    vectors = sm.Buffer((pr.stages, pr.bq), jnp.float32, tiled=False)
    buffers: tuple[Any, ...] = (rows, rows, ring, ring, vectors, vectors)
    if _dkv_out_dtype(pr) != pr.dtype:
        buffers = (*buffers, sm.Buffer((2, pr.bk, pr.d), jnp.float32, tiled=False))
    return [
        buffers,
        sm.Barriers(2),  # K landed
        sm.Barriers(2),  # V landed
        sm.Barriers(pr.stages),  # Q landed
        sm.Barriers(pr.stages),  # dO landed
        sm.Barriers(pr.stages),  # lse landed
        sm.Barriers(pr.stages),  # delta landed
        sm.Barriers(pr.stages, num_arrivals=2),  # ring slot free
    ]


def bwd_smem(pr: Problem) -> int:
    """Bytes of shared memory the larger of the two backward kernels of ``pr`` allocates."""
    return max(sm.nbytes(dq_scratch(pr)), sm.nbytes(dkv_scratch(pr)))


def _dkv_out_dtype(pr: Problem) -> Any:
    """dK/dV per query head: summed over a GQA group afterwards, in float32."""
    return pr.dtype if pr.group == 1 else jnp.float32


def dq_call(q, k, v, do, lse, delta, pr: Problem) -> jax.Array:
    """dQ [B, Sq, Hq, D]: consumers own query rows and stream K/V."""
    return mg.launch(
        pr,
        functools.partial(_bwd_dq_kernel, pr=pr),
        out=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch=sm.build(pr, dq_scratch(pr)),
        grid=mg.head_grid(pr, "q_tiles", pr.sq // (2 * pr.bq)),
        name="ejkernel_flash_attention_bwd_dq",
    )(q, k, v, do, lse, delta)


def _bwd_dq_kernel(*refs, pr: Problem):
    pl, plgpu = _compat.pl, _compat.plgpu()
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, smem, *barriers = refs
    q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem = smem
    q_landed, do_landed, lse_landed, delta_landed, k_landed, v_landed, kv_free, *k_copied = barriers
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile_q0 = lax.axis_index("q_tiles") * (2 * pr.bq)
    cta_steps = pr.kv_steps(tile_q0 + pr.bq)
    bq, bk, d = pr.bq, pr.bk, pr.d

    @mg.consumers(wg)
    def _consumer():
        q0 = tile_q0 + wg * bq
        steps, full = pr.kv_blocks(q0)
        rows, vec = (b, pl.ds(q0, bq), h), (b, h, pl.ds(q0, bq))
        mg.copy_own(
            wg,
            (q_ref.at[rows], q_smem2, q_landed),
            (do_ref.at[rows], do_smem2, do_landed),
            (lse_ref.at[vec], lse_smem2, lse_landed),
            (delta_ref.at[vec], delta_smem2, delta_landed),
        )
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        lse = mg.load_row_vector(pr, lse_smem2.at[wg], 1)
        delta = mg.load_row_vector(pr, delta_smem2.at[wg], 1)
        dq = mg.layout(pr, jnp.full((bq, d), 0.0, jnp.float32), "WGMMA")

        def step(j, dq, masked: bool):
            slot = lax.rem(j, jnp.int32(pr.stages))
            plgpu.barrier_wait(k_landed.at[slot])
            s = mg.mma(pr, q_smem, k_smem.at[slot], (bq, bk), transpose_b=True)
            s = s * (pr.scale * mg.LOG2E)
            if masked:
                vis = mg.causal_visible(pr, (bq, bk), q0, j * bk)
                s = jnp.where(vis, s, -jnp.inf)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            plgpu.barrier_wait(v_landed.at[slot])
            dp = mg.mma(pr, do_smem, v_smem.at[slot], (bq, bk), transpose_b=True)
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            if masked:  # hidden: p is 0, dP of a hidden non-finite value NaN (K is clean)
                ds = hide(ds, p > 0.0)
            dq = mg.mma_acc(pr, dq, ds.astype(pr.dtype), k_smem.at[slot])
            plgpu.barrier_arrive(kv_free.at[slot])
            return dq

        dq = lax.fori_loop(0, full, functools.partial(step, masked=False), dq)
        if pr.causal:
            dq = lax.fori_loop(full, steps, functools.partial(step, masked=True), dq)
            mg.release_slots(pr, steps, cta_steps, (k_landed, v_landed), kv_free)
        q_smem[...] = (dq * pr.scale).astype(pr.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @mg.producer(wg)
    def _producer():
        kv_h = lax.div(h, jnp.int32(pr.group))
        masked_from = pr.kv_full_steps(tile_q0, cta_steps)  # the first consumer's first cut

        def copy(j, slot, k_barrier):
            rows = (b, pl.ds(j * bk, bk), kv_h)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_barrier.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_landed.at[slot])

        def load(j, slot):
            if not pr.causal:
                copy(j, slot, k_landed)
                return
            pl.when(j < masked_from)(lambda: copy(j, slot, k_landed))
            pl.when(j >= masked_from)(lambda: copy(j, slot, k_copied[0]))

        clean = mg.clean_cut_tiles(pr, masked_from, k_smem, k_copied, k_landed)
        mg.produce(pr, cta_steps, load, (kv_free,), start=jnp.int32(0), landed=clean)


def dkv_call(q, k, v, do, lse, delta, pr: Problem) -> tuple[jax.Array, jax.Array]:
    """dK, dV per query head [B, Sk, Hq, D] (float32 when summed over a GQA group after)."""
    out_dtype = _dkv_out_dtype(pr)
    shape = (pr.b, pr.sk, pr.hq, pr.d)
    return mg.launch(
        pr,
        functools.partial(_bwd_dkv_kernel, pr=pr, out_dtype=out_dtype),
        out=[jax.ShapeDtypeStruct(shape, out_dtype)] * 2,
        scratch=sm.build(pr, dkv_scratch(pr)),
        grid=mg.head_grid(pr, "kv_tiles", pr.sk // (2 * pr.bk)),
        name="ejkernel_flash_attention_bwd_dkv",
    )(q, k, v, do, lse, delta)


def _bwd_dkv_kernel(*refs, pr: Problem, out_dtype: Any):
    pl, plgpu = _compat.pl, _compat.plgpu()
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, smem, *barriers = refs
    k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *f32_out = smem
    k_landed, v_landed, q_landed, do_landed, lse_landed, delta_landed, free = barriers
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile_k0 = lax.axis_index("kv_tiles") * (2 * pr.bk)
    cta_start = pr.q_start(tile_k0)  # the first consumer's keys are seen earliest
    bq, bk, d = pr.bq, pr.bk, pr.d
    kv_h = lax.div(h, jnp.int32(pr.group))
    ring = (q_landed, do_landed, lse_landed, delta_landed)

    @mg.consumers(wg)
    def _consumer():
        k0 = tile_k0 + wg * bk
        start, full_from = pr.q_blocks(k0)
        rows = (b, pl.ds(k0, bk), kv_h)
        mg.copy_own(wg, (k_ref.at[rows], k_smem2, k_landed), (v_ref.at[rows], v_smem2, v_landed))
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        zeros = jnp.full((bk, d), 0.0, jnp.float32)
        carry = (mg.layout(pr, zeros, "WGMMA"), mg.layout(pr, zeros, "WGMMA"))
        if pr.causal:
            mg.release_slots(pr, cta_start, start, ring, free, origin=cta_start)

        def step(i, carry, masked: bool):
            dk, dv = carry
            slot = lax.rem(i - cta_start, jnp.int32(pr.stages))
            plgpu.barrier_wait(q_landed.at[slot])
            s_t = mg.mma(pr, k_smem, q_smem.at[slot], (bk, bq), transpose_b=True)
            s_t = s_t * (pr.scale * mg.LOG2E)
            plgpu.barrier_wait(lse_landed.at[slot])
            lse = mg.load_row_vector(pr, lse_smem.at[slot], 0)
            s_t = s_t - lax.broadcast_in_dim(lse, s_t.shape, [1])
            if masked:  # after the lse: a row's non-finite lse must not reach keys it cannot see
                vis = mg.causal_visible(pr, (bk, bq), i * bq, k0, q_axis=1)
                s_t = jnp.where(vis, s_t, -jnp.inf)
            p_t = jnp.exp2(s_t)
            plgpu.barrier_wait(do_landed.at[slot])
            dv = mg.mma_acc(pr, dv, p_t.astype(pr.dtype), do_smem.at[slot])
            dp_t = mg.mma(pr, v_smem, do_smem.at[slot], (bk, bq), transpose_b=True)
            plgpu.barrier_wait(delta_landed.at[slot])
            delta = mg.load_row_vector(pr, delta_smem.at[slot], 0)
            ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
            if masked:  # likewise its Δ, and dP of a non-finite value
                ds_t = hide(ds_t, p_t > 0.0)
            dk = mg.mma_acc(pr, dk, ds_t.astype(pr.dtype), q_smem.at[slot])
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        carry = lax.fori_loop(start, full_from, functools.partial(step, masked=True), carry)
        dk, dv = lax.fori_loop(full_from, pr.nq, functools.partial(step, masked=False), carry)
        out_rows = (b, pl.ds(k0, bk), h)
        if f32_out:
            tmp = f32_out[0].at[wg]
            tmp[...] = dk * pr.scale
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tmp, dk_ref.at[out_rows])
            plgpu.wait_smem_to_gmem(0)
            tmp[...] = dv
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tmp, dv_ref.at[out_rows])
            plgpu.wait_smem_to_gmem(0)
        else:
            k_smem[...] = (dk * pr.scale).astype(out_dtype)
            v_smem[...] = dv.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[out_rows])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[out_rows])
            plgpu.wait_smem_to_gmem(0)

    @mg.producer(wg)
    def _producer():

        def load(i, slot):
            rows = (b, pl.ds(i * bq, bq), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_landed.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_landed.at[slot])
            vec = (b, h, pl.ds(i * bq, bq))
            plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[slot], lse_landed.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[slot], delta_landed.at[slot])

        mg.produce(pr, jnp.int32(pr.nq), load, (free,), start=cta_start)
