"""flash_attention (and scaled_dot_product_attention) as Pallas Mosaic-GPU kernels for Hopper.

Algorithm: FlashAttention-2 (Dao, 2023) scheduled the FlashAttention-3 way (Shah et al., 2024,
Sec. 3.1-3.2) on an H100: every CTA runs three warpgroups; one is a producer that streams key
and value tiles from global to shared memory with the bulk tensor copy engine (TMA) into a
ring of ``num_stages`` slots guarded by mbarriers, two are consumers that each own ``bq`` query
rows and run the warpgroup matrix instructions (``wgmma``) for ``S = QKᵀ`` and ``O += PV`` with
the online softmax in registers between them. A ping-pong on two hardware named barriers
between the two consumers lets one warpgroup's softmax overlap the other's matmuls (FA3 Sec.
3.1). The softmax runs in base 2 (``exp2(s · scale · log2 e − m)``, one FMA a logit), with the
logsumexp saved in base 2 for the backward.

- Forward: grid (Hq, Sq / 2bq, B); each consumer loops over the kv blocks its rows can see.
  Causal (bottom-right aligned): the blocks every row sees run unmasked, the diagonal ones
  masked, and the rest are never loaded (the producer stops at the CTA's last visible block;
  a consumer that finishes earlier releases the remaining ring slots; query tiles launch
  longest first, so the last wave is short). Non-causal at D 64 with
  more tiles than SMs, the forward is persistent instead: one CTA per SM walks its tiles, its
  producer streams their K/V through one ring (the next tile's loads overlap this tile's
  epilogue), and each consumer reloads Q before writing its output from a separate buffer.
  Non-causal at D 128 the kv tiles have 192 rows (FA3's wide tiles: fewer steps); where 192
  does not divide Sk, one or two final steps use the first 128 rows of their ring slots.
- Backward: ``Δ = rowsum(dO ∘ O)`` in XLA, then two kernels with the same producer/consumer
  structure: ``dQ`` (consumers own query rows, stream K/V) and ``dK``/``dV`` (consumers own key
  rows, stream Q, dO, logsumexp and Δ; causal starts each consumer at its first visible query
  block). GQA: a query head reads kv head ``h // G``; ``dK``/``dV`` are computed per query head
  and summed over the group in float32.

Masking is :func:`ejkernel.attention_semantics.visible` (the causal term; the kernels take no
other). Hidden scores are selected out; on a diagonal (partially visible) block the streamed
shared-memory operand that multiplies probabilities (V in the forward, K in ``dQ``) is
rewritten through ``finite_or_zero`` by the producer and hidden ``P``/``dS`` are exactly zero,
so a hidden NaN or Inf reaches no row (:mod:`ejkernel.attention_semantics`); fully visible
blocks run untouched.

Declined in ``supports()`` (the XLA plugin serves them): everything but bf16/f16 inputs; head
dims other than 64/128 or ``Dv != D``; sequence lengths that are not multiples of 128;
sliding window, soft cap, segment ids, bias, masks, sinks, dropout; GPUs older than Hopper.

Modules: this one holds the config rules, ``supports()`` and the registered entry with its
VJP; :mod:`._problem` the static launch geometry; :mod:`.flash_attention_fwd` and
:mod:`.flash_attention_bwd` the kernels; :mod:`._mosaic` their Mosaic GPU building blocks.

Interpret mode: the kernels run on the CPU in Mosaic GPU's interpret mode (warpgroups,
barriers, TMA copies and shared memory simulated) with the ``wgmma`` calls replaced by
``jnp.dot`` on the same shared-memory tiles (the interpreter does not model WGMMA
accumulators); the consumers' named-barrier ping-pong only orders work and is skipped there.
``tests/pallas/test_flash_attention_gpu.py`` runs one body in both modes; the ``gpu`` mode and
``benchmarks/bench_pallas_gpu.py`` exercise the real lowering. The masking rule (hidden NaN/Inf)
is held in interpret mode by ``tests/core/test_attention_semantics.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.ops import prune_by_shared_memory
from ejkernel.plugins import defvjp
from ejkernel_pallas._attention import (
    FlashAttentionConfig,
    blocks_config,
    declined_features,
    refuse_declined,
    unique_configs,
)
from ejkernel_pallas.gpu import _problem as pb
from ejkernel_pallas.gpu import hopper_reason
from ejkernel_pallas.gpu._problem import Problem
from ejkernel_pallas.gpu.flash_attention_bwd import bwd_smem, dkv_call, dq_call
from ejkernel_pallas.gpu.flash_attention_fwd import fwd_call, fwd_smem

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_pallas",
    "heuristic",
    "smem_need",
    "supports",
]

#: D 256 is declined: the backward's K, V and the Q/dO ring of two 64-row tiles need 256 KiB of
#: shared memory, over the H100's 227 KiB.
HEAD_DIMS = (64, 128)
SEQ_MULTIPLE = 128
DTYPES = ("bfloat16", "float16")
#: (bq, bk, stages) candidates the config space adds to the heuristic's.
TUNING = ((64, 64, 2), (64, 128, 2), (64, 128, 3), (64, 64, 3))


#: Arguments these kernels decline beyond :data:`~ejkernel_pallas._attention.DECLINED`.
DECLINED = (
    ("sliding_window", "a sliding window"),
    ("logits_soft_cap", "a logits soft cap"),
    ("q_segment_ids", "segment ids"),
)


def heuristic(inv: Any) -> FlashAttentionConfig:
    """FA3's blocks for the head dim (two consumers of 64 query rows, kv tiles of 64-128)."""
    d = inv.kwargs["query"].shape[3]
    fwd = pb.fwd_defaults(d, bool(inv.kwargs.get("causal")))
    return blocks_config(fwd, pb.BWD_DEFAULT.get(d, (64, 64, 2)))


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic's config, then a few (bq, bk, stages) triples for both passes, minus those
    whose kernels need more shared memory than the device grants (:func:`smem_need`; the
    heuristic's stays)."""
    base = heuristic(inv)
    return prune_by_shared_memory(
        unique_configs([base, *(blocks_config(t, t) for t in TUNING)]),
        functools.partial(smem_need, inv.kwargs, grad=getattr(inv, "grad", True)),
        keep=(base,),
        what="flash_attention (pallas gpu)",
    )


def smem_need(kw: Any, cfg: FlashAttentionConfig, *, grad: bool = True) -> int:
    """Bytes of shared memory the largest kernel of ``cfg`` allocates for the call ``kw``: the
    forward, and with ``grad`` the dQ and dK/dV kernels (a differentiated call is tuned on
    both passes), their scratch as Mosaic GPU lays it out (:mod:`._smem`). 0 for blocks that
    do not tile the call (the kernels refuse them before compiling anything)."""
    q, k = kw["query"], kw["key"]
    args = {"softmax_scale": kw.get("softmax_scale"), "causal": bool(kw.get("causal"))}
    try:
        need = fwd_smem(Problem.of(q, k, cfg, backward=False, **args))
        if grad:
            need = max(need, bwd_smem(Problem.of(q, k, cfg, backward=True, **args)))
    except ValueError:
        return 0
    return need


def supports(inv: Any) -> bool | str:
    """True, or why these kernels cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    declined = declined_features(kw, DECLINED, "the Pallas Mosaic GPU kernels")
    if declined:
        return declined
    q, k, v = kw["query"], kw["key"], kw["value"]
    dtype = jnp.dtype(q.dtype).name
    if dtype not in DTYPES:
        return f"the Pallas Mosaic GPU kernels take {'/'.join(DTYPES)}; got {dtype}"
    d, dv = q.shape[3], v.shape[3]
    if d not in HEAD_DIMS or dv != d:
        return f"the Pallas Mosaic GPU kernels take D = Dv in {HEAD_DIMS}; got D={d}, Dv={dv}"
    sq, sk = q.shape[1], k.shape[1]
    if sq % SEQ_MULTIPLE or sk % SEQ_MULTIPLE:
        return (
            f"the Pallas Mosaic GPU kernels take Sq and Sk multiples of {SEQ_MULTIPLE}; "
            f"got Sq={sq}, Sk={sk}"
        )
    return hopper_reason("the Pallas Mosaic GPU kernels need") or True


def flash_attention_pallas(*, cfg: FlashAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Flash attention on Mosaic GPU: ``ejkernel.flash_attention``'s arguments as keywords,
    validated by the core spec.

    Args:
        query: [B, Sq, Hq, D], bf16/f16.
        key: [B, Sk, Hkv, D].
        value: [B, Sk, Hkv, D].
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        causal: bottom-right aligned causal mask.
        cfg: blocks and pipeline depth; ``None`` takes the heuristic's.
        The other arguments must be absent (``supports()`` declines them).

    Returns:
        [B, Sq, Hq, D] in the query dtype.
    """
    out, _ = _flash_attention_fwd(cfg=cfg, **args)
    return out


def _flash_attention_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    softmax_scale: float | None = None,
    causal: bool = False,
    cfg: FlashAttentionConfig | None = None,
    **declined: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Forward: ``(out, residuals)`` with the base-2 logsumexp [B, Hq, Sq] (float32)."""
    refuse_declined(declined, DECLINED)
    pr = Problem.of(query, key, cfg, backward=False, softmax_scale=softmax_scale, causal=causal)
    out, lse = fwd_call(query, key, value, pr)
    return out, {"query": query, "key": key, "value": value, "out": out, "lse": lse}


def _flash_attention_bwd(
    residuals: dict[str, jax.Array],
    d_out: jax.Array,
    *,
    cfg: FlashAttentionConfig | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    **declined: Any,
) -> dict[str, jax.Array]:
    """Backward: gradients of query, key and value."""
    del declined
    q, k, v = residuals["query"], residuals["key"], residuals["value"]
    pr = Problem.of(q, k, cfg, backward=True, softmax_scale=softmax_scale, causal=causal)
    do = d_out.astype(q.dtype)
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", residuals["out"].astype(jnp.float32), do.astype(jnp.float32)
    )
    dq = dq_call(q, k, v, do, residuals["lse"], delta, pr)
    dk, dv = dkv_call(q, k, v, do, residuals["lse"], delta, pr)
    if pr.group > 1:  # per query head -> per kv head
        b, sk, hkv, d = k.shape
        dk = dk.reshape(b, sk, hkv, pr.group, d).sum(axis=3)
        dv = dv.reshape(b, sk, hkv, pr.group, d).sum(axis=3)
    return {"query": dq, "key": dk.astype(k.dtype), "value": dv.astype(v.dtype)}


defvjp(flash_attention_pallas, _flash_attention_fwd, _flash_attention_bwd)
