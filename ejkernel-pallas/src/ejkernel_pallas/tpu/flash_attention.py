"""flash_attention (and scaled_dot_product_attention) as Pallas Mosaic-TPU kernels.

Algorithm: FlashAttention-2 (Dao, 2023), forward Alg. 1 with the online softmax, backward
Alg. 2 split in two kernels (``dQ`` over kv blocks; ``dK``/``dV`` over query blocks), as on
TPUs there are no atomics to merge them.

Layout and tiling. Inputs go to ``[B, H, S, D]``; the head dims are zero-padded to a multiple of
128 lanes (D 80 becomes 128: zeros change no dot product) and sequences to whole blocks. Query
blocks are multiples of 8 sublanes, kv blocks multiples of 128 lanes, so every tile (``[bq, D]``,
``[bk, D]``, the ``[bq, bk]`` logits) is made of whole (8, 128) vregs; the heuristic sizes the
blocks so one grid step's working set fits the scoped VMEM. Row statistics (running max,
denominator, logsumexp, the backward's ``rowsum(dO ∘ O)``) are kept replicated over 128 lanes,
and segment ids of queries over 128 lanes and of keys over 8 sublanes, so they load as whole
tiles. Every kernel runs on a grid whose last axis (or last two) is a reduction ("arbitrary"),
accumulating in VMEM scratch in float32; matmul inputs keep the input dtype.

Masking is :mod:`ejkernel.attention_semantics` (bottom-right aligned causal, sliding window
``(left, right)``, segment ids, padded keys): hidden scores are selected to its ``MASK_VALUE``
and hidden probabilities and score gradients to exact zeros; on every masked block the keys and
values enter the products through ``finite_or_zero``, so a NaN or Inf the mask hides from a row
never reaches it. A row with no visible key returns zeros with zero gradients. Causal and
window masks skip whole blocks twice over: compute is predicated off (``pl.when`` on
:meth:`~ejkernel.attention_semantics.Geometry.block_may_see`) and the index maps clamp the block
fetched to the visible range, so a skipped step re-uses the block already in VMEM instead of
issuing a DMA. GQA: a query head reads kv head ``h // G``; ``dK``/``dV`` of a kv head accumulate
over its ``G`` query heads inside the kernel (grid axes ``(G, nq)``). Soft cap: ``cap · tanh(s /
cap)`` in the forward, and the chain rule ``(1 - tanh²)`` backward.

Declined in ``supports()`` (the XLA plugin serves them): bias, dense attention_mask, sinks
(softmax_aux), dropout; dtypes other than float32/bfloat16/float16; head dims over 512.

Modules: this one holds the config rules, ``supports()`` and the registered entry with its
VJP; :mod:`._problem` the launch geometry and layout; :mod:`.flash_attention_kernels` the
kernels and their launches.

Verified without a TPU: ``tests/pallas/test_flash_attention_tpu.py`` runs these
kernels on the CPU in Pallas's TPU interpret mode (``pltpu.InterpretParams``: HBM/VMEM memory
spaces, DMAs and the grid simulated) against ``flash_attention_reference`` in float32 (1e-5)
and bfloat16 (1e-2), forward and gradients, for every feature above (odd lengths 37/129,
head dim 80, GQA, several blocks per axis). Mosaic's lowering to a real TPU (layouts of the
lane slices and transposed matmuls) has not been run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import EMPTY_ROW_LSE
from ejkernel.plugins import deflse, defvjp
from ejkernel_pallas._attention import (
    FlashAttentionConfig,
    Shapes,
    blocks_config,
    declined_features,
    refuse_declined,
    unique_configs,
)
from ejkernel_pallas.tpu._problem import (
    BWD_BLOCKS,
    FWD_BLOCKS,
    LANES,
    Problem,
    fit_blocks,
    from_kernel_layout,
    kernel_segments,
    pad_to,
    to_kernel_layout,
)
from ejkernel_pallas.tpu.flash_attention_kernels import dkv_call, dq_call, fwd_call

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_pallas",
    "heuristic",
    "supports",
]

MAX_HEAD_DIM = 512
DTYPES = ("float32", "bfloat16", "float16")
#: (q, kv) block pairs offered to the autotuner.
TUNING_BLOCKS = ((128, 128), (128, 256), (256, 256), (256, 512), (512, 512), (512, 1024))


def _fitted(fwd: tuple[int, int], bwd: tuple[int, int], inv: Any) -> FlashAttentionConfig:
    """The config of a forward and a backward block pair, each fitted to its pass."""
    p = Shapes.of(inv.kwargs["query"], inv.kwargs["key"], inv.kwargs["value"])
    return blocks_config(fit_blocks(fwd, p, backward=False), fit_blocks(bwd, p, backward=True))


def heuristic(inv: Any) -> FlashAttentionConfig:
    """Default blocks clamped to the sequences and shrunk to the VMEM budget."""
    return _fitted(FWD_BLOCKS, BWD_BLOCKS, inv)


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic's config, then the tuning pairs that fit (duplicates after clamping once)."""
    return unique_configs([heuristic(inv), *(_fitted(p, p, inv) for p in TUNING_BLOCKS)])


def supports(inv: Any) -> bool | str:
    """True, or why these kernels cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    declined = declined_features(kw)
    if declined:
        return declined
    dtype = jnp.dtype(kw["query"].dtype).name
    if dtype not in DTYPES:
        return f"the Pallas TPU kernels take {'/'.join(DTYPES)}; got {dtype}"
    d, dv = kw["query"].shape[3], kw["value"].shape[3]
    if max(d, dv) > MAX_HEAD_DIM:
        return f"the Pallas TPU kernels take head dims up to {MAX_HEAD_DIM}; got D={d}, Dv={dv}"
    return True


def flash_attention_pallas(*, cfg: FlashAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Flash attention on Mosaic TPU: ``ejkernel.flash_attention``'s arguments as keywords,
    validated by the core spec.

    Args:
        query: [B, Sq, Hq, D].
        key: [B, Sk, Hkv, D].
        value: [B, Sk, Hkv, Dv].
        bias, attention_mask, softmax_aux, dropout_prob, dropout_seed: must be absent / zero
            (``supports()`` declines them).
        q_segment_ids: [B, Sq] int; with ``kv_segment_ids`` [B, Sk].
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        causal: bottom-right aligned causal mask.
        sliding_window: ``(left, right)`` or ``None``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` or ``None``.
        cfg: block sizes; ``None`` takes the heuristic's.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    out, _ = _flash_attention_fwd(cfg=cfg, **args)
    return out


def _flash_attention_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    **statics: Any,
) -> tuple[jax.Array, dict[str, Any]]:
    """Forward: ``(out, residuals)``; residuals hold the kernel-layout inputs, output and lse."""
    refuse_declined(statics)
    pr = Problem.of(query, key, value, q_segment_ids, statics, backward=False)
    q, k, v = to_kernel_layout(query, key, value, pr)
    segs = kernel_segments(q_segment_ids, kv_segment_ids, pr)
    out, lse = fwd_call(q, k, v, segs, pr)
    out = from_kernel_layout(out, pr)
    residuals = {
        "query": query,
        "key": key,
        "value": value,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
        "out": out,
        "logsumexp": lse[:, :, : pr.sq, 0],  # [B, Hq, Sq]: one lane of the replicated rows
    }
    return out, residuals


def _flash_attention_bwd(
    residuals: dict[str, Any], d_out: jax.Array, **statics: Any
) -> dict[str, jax.Array | None]:
    """Backward: gradients of query, key and value (in their dtypes)."""
    query, key, value = residuals["query"], residuals["key"], residuals["value"]
    pr = Problem.of(query, key, value, residuals["q_segment_ids"], statics, backward=True)
    q, k, v = to_kernel_layout(query, key, value, pr)
    segs = kernel_segments(residuals["q_segment_ids"], residuals["kv_segment_ids"], pr)
    rows = (pr.b, pr.hq, pr.sq_pad)
    lse = pad_to(residuals["logsumexp"], rows, EMPTY_ROW_LSE)
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", residuals["out"].astype(jnp.float32), d_out.astype(jnp.float32)
    )
    lse, delta = (
        jnp.broadcast_to(pad_to(x, rows)[..., None], (*rows, LANES)) for x in (lse, delta)
    )
    do = pad_to(jnp.swapaxes(d_out.astype(query.dtype), 1, 2), (*rows, pr.dv_pad))
    inputs = (q, k, v, do, lse, delta)
    dq = dq_call(inputs, segs, pr)
    dk, dv = dkv_call(inputs, segs, pr)
    return {
        "query": jnp.swapaxes(dq[:, :, : pr.sq, : pr.d], 1, 2),
        "key": jnp.swapaxes(dk[:, :, : pr.sk, : pr.d], 1, 2),
        "value": jnp.swapaxes(dv[:, :, : pr.sk, : pr.dv], 1, 2),
    }


def _flash_attention_lse_fwd(
    *, cfg: FlashAttentionConfig | None = None, **args: Any
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse [B, Sq, Hq])`` (the kernel's natural-log lse; an empty row's is
    ``EMPTY_ROW_LSE``): one ring step (:func:`ejkernel.plugins.deflse`)."""
    out, residuals = _flash_attention_fwd(cfg=cfg, **args)
    return out, jnp.swapaxes(residuals["logsumexp"], 1, 2)


def _flash_attention_lse_bwd(
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    cfg: FlashAttentionConfig | None = None,
    **args: Any,
) -> dict[str, jax.Array | None]:
    """Gradients from the softmax statistics ``out`` and ``lse`` [B, Sq, Hq] given by the caller
    (those of a larger softmax on a ring)."""
    arrays = ("query", "key", "value", "q_segment_ids", "kv_segment_ids")
    residuals = {n: args.get(n) for n in arrays}
    residuals |= {"out": out, "logsumexp": jnp.swapaxes(lse.astype(jnp.float32), 1, 2)}
    statics = {n: v for n, v in args.items() if n not in arrays}
    return _flash_attention_bwd(residuals, d_out, cfg=cfg, **statics)


defvjp(flash_attention_pallas, _flash_attention_fwd, _flash_attention_bwd)
deflse(flash_attention_pallas, _flash_attention_lse_fwd, _flash_attention_lse_bwd)
