"""flash_attention (and scaled_dot_product_attention) in Triton: launch wrappers, fwd and bwd.

The kernels are in :mod:`ejkernel_triton.kernels.flash_attention` (and the Gluon kernels for
Hopper in :mod:`ejkernel_triton.kernels.flash_attention_hopper`); this module checks what they
serve (:func:`supports`), picks block sizes (:func:`heuristic`, :func:`config_space`), lays the
arguments out for them and wires forward and backward through :func:`ejkernel.plugins.defvjp`:

- forward: one kernel, output ``[B, Sq, Hq, Dv]`` and the per-row log2-sum-exp ``[B, Hq, Sq]``
  (float32, the only residual besides the inputs and the output);
- backward: the dQ kernel (one program per query block and query head), which also computes
  ``delta = rowsum(dO ∘ O)`` and writes the logit gradient when there is a bias, then the dK/dV
  kernel (one program per key block and key head, looping over the group's query heads: no
  K/V repeat, no atomics); the sink gradient is ``-Σ p_sink · delta``, in JAX. In the plain
  case on a Hopper GPU with Gluon the backward is one Gluon kernel (:func:`_bwd_gluon`: dQ
  accumulates in float32 by TMA reduce-adds across the key blocks' programs, so its last bits
  depend on their order; at D 64 causal dK and dV only, after the usual dQ kernel), and under
  ``warp_specialize`` without Gluon the warp-specialized dK/dV and dQ kernels; both take
  delta from JAX.

Everything of OPS.md's flash_attention is served except dropout, which :func:`supports`
declines (the XLA platform then serves the call). Both functions compose with ``jit``,
``grad`` and ``vmap`` (:func:`ejkernel_triton._launch.fold_vmap` folds vmapped axes into the
batch of the grid).
"""

from __future__ import annotations

import functools
import math
import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel._params import BwdParams, FwdParams
from ejkernel.plugins import defvjp
from ejkernel_triton import _launch
from ejkernel_triton._launch import BATCH, BROADCAST, OTHER

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_triton",
    "heuristic",
    "scaled_dot_product_attention_triton",
    "supports",
]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@attrs.frozen(kw_only=True)
class FlashAttentionConfig:
    """Tunables of the Triton flash attention.

    Attributes:
        fwd_params: forward kernel: ``q_blocksize`` rows per program, ``kv_blocksize`` keys
            per step, ``num_warps``, ``num_stages``.
        bwd_params: dK/dV kernel: ``kv_blocksize`` keys per program, ``q_blocksize`` queries
            per step, warps, stages.
        dq_params: dQ kernel: ``q_blocksize`` rows per program, ``kv_blocksize`` keys per step;
            ``None`` takes ``bwd_params`` with the two block sizes swapped.
        warp_specialize: run the forward, dK/dV and dQ kernels as the warp-specialized TMA
            kernels (``flash_attention_fwd_ws_kernel``, ``flash_attention_bwd_dkdv_ws_kernel``,
            ``flash_attention_bwd_dq_ws_kernel``: a producer warp group and two consumer warp
            groups, ``num_warps`` each) where they apply: a Hopper GPU (or the interpreter),
            bf16/f16, D = Dv of 64 or 128, no bias, mask, segment ids, window or sinks. On a
            GPU at D 128 the forward is the Gluon kernel ``flash_attention_fwd_pingpong_kernel``
            instead (FlashAttention-3's schedule: the two consumers take turns on the tensor
            cores). On a GPU each runs its one validated config (``_WS_FWD`` or
            ``_PINGPONG_FWD``, ``_WS_DKDV``, ``_WS_DQ``) whatever
            ``fwd_params``/``bwd_params``/``dq_params`` say; the interpreter takes their block
            sizes. Elsewhere the usual kernels run, with the given params, except that in the
            same plain case on a Hopper GPU with Gluon the backward is always the Gluon kernel
            ``flash_attention_bwd_gluon_kernel`` (dQ, dK and dV; ``_GLUON_BWD``), whether
            ``warp_specialize`` is set or not; at D 64 causal it computes dK and dV only, after
            the usual dQ kernel (``_gluon_fuses_dq``).
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    bwd_params: BwdParams = attrs.field(factory=BwdParams)
    dq_params: FwdParams | None = None
    warp_specialize: bool = False


# -- what is served -------------------------------------------------------------------------


def supports(inv: Any) -> bool | str:
    """True, or why not: dropout, head dims over 256, dtypes other than bf16/f16/f32."""
    a = inv.kwargs
    if a.get("dropout_prob", 0.0):
        return "dropout is not implemented in the Triton kernels (the xla platform serves it)"
    q, k, v = a["query"], a["key"], a["value"]
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dtype not in _DTYPES:
            return f"{name} dtype {x.dtype} (Triton kernels take bfloat16, float16, float32)"
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        return "query, key and value dtypes differ"
    if max(q.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {_MAX_HEAD_DIM}"
    return True


# -- configs --------------------------------------------------------------------------------


def heuristic(inv: Any) -> FlashAttentionConfig:
    """Block sizes by head dim and causality (measured on an H100; see benchmarks/RESULTS.md)."""
    q, v = inv.kwargs["query"], inv.kwargs["value"]
    causal = bool(inv.kwargs.get("causal"))
    d = _pow2(max(q.shape[-1], v.shape[-1]))
    sq, sk = q.shape[1], inv.kwargs["key"].shape[1]
    if _launch.interpreting():  # the interpreter's cost is per program: few, large blocks
        bq, bk = _clamp(64, sq), _clamp(64, sk)
        return FlashAttentionConfig(
            fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=4, num_stages=1),
            bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=4, num_stages=1),
        )
    if q.dtype == jnp.float32:  # four-byte tiles: half the blocks of bf16
        fwd = FwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4, num_stages=2)
        bwd = BwdParams(q_blocksize=16, kv_blocksize=64, num_warps=4, num_stages=2)
    elif d == 128 and _ws_candidate(inv.kwargs):
        # H100, (4, 4096, 16, 128) bf16: the specialized kernels beat the usual ones in each
        # of the three (RESULTS.md, eighth and ninth sessions); at D 64 they do not
        return FlashAttentionConfig(fwd_params=_WS_FWD, bwd_params=_BWD_D128, warp_specialize=True)
    elif d <= 64:  # H100, (8, 2048, 16, 64) bf16: each kernel's best (RESULTS.md, 11th session)
        plain_d64 = not causal and q.shape[-1] == v.shape[-1] == 64 and _plain_scale(inv.kwargs)
        return FlashAttentionConfig(
            fwd_params=_FWD_D64_PLAIN if plain_d64 else _FWD_D128,
            bwd_params=_BWD_D64_CAUSAL if causal else _BWD_D64,
            dq_params=_DQ_D64,
        )
    elif d <= 128:  # H100, (4, 4096, 16, 128) bf16, where the specialized kernels do not apply
        fwd, bwd = _FWD_D128, _BWD_D128_CAUSAL if causal else _BWD_D128
    else:
        fwd = FwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4, num_stages=2)
        bwd = BwdParams(q_blocksize=16, kv_blocksize=64, num_warps=4, num_stages=2)
    return FlashAttentionConfig(fwd_params=fwd, bwd_params=bwd)


#: The warp-specialized forward's one config: the compiler's partitioning gave wrong results
#: on the H100 with 64-key blocks or a third stage (triton 3.6), so neither is offered. Run
#: persistent (``_persistent_programs``): 1.13x / 1.09x one program per tile at D 128,
#: non-causal / causal (RESULTS.md, ninth session).
_WS_FWD = FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2)
#: ... and of the warp-specialized dK/dV kernel (the same limits): 128 keys per program.
_WS_DKDV = BwdParams(q_blocksize=64, kv_blocksize=128, num_warps=4, num_stages=2)
#: ... and of the warp-specialized dQ kernel (H100, D 128: 1.19x / 1.07x the usual dQ kernel,
#: non-causal / causal). Not persistent: as a persistent kernel (as the forward) 64-key steps
#: gave NaN and 128-key steps need one stage to fit, 20 % slower (RESULTS.md, ninth session).
_WS_DQ = FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2)
#: The usual forward folds the softmax scale into the exponent where nothing is masked or
#: added (``PLAIN_SCALE``). H100, (8, 2048, 16, 64), 64x64 blocks: 384 / 309 TFLOP/s against
#: 367 / 296 without, non-causal / causal (RESULTS.md, seventeenth session). Experiments turn
#: it off to measure it.
_SCALE_IN_EXP = True

#: The Gluon forward (``flash_attention_fwd_pingpong_kernel``), which replaces the one above on
#: a GPU at D 128: a 128-row tile (two consumers of 64), 128-key blocks, a ring of 3 K/V slots
#: (225 KiB of shared memory). H100: 570 / 464 TFLOP/s against the above's 512 / 425,
#: non-causal / causal, 128-key blocks with 2 slots 529 / 442, 64-key with 3 slots 493 / 387
#: (RESULTS.md, tenth session). Not persistent.
_PINGPONG_FWD = FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=3)
#: ... and its causal program order (the kernels' ``_program_tile``; 0: grid order): longest
#: query tiles first in groups of 8 heads. H100, causal, B·S 16384, H 16: forward 481 / 541
#: TFLOP/s at S 4096 / 8192 against 462 / 523 in grid order (16 heads: 478 / 538); fwd+bwd
#: within noise (RESULTS.md, fourteenth session).
_PINGPONG_HEAD_GROUP = 8
#: The backward kernels' causal program order, as the forward's: the longest programs first
#: (dQ: the last query blocks; dK/dV and the Gluon backward: the first key blocks) in groups of
#: 8 heads. H100, (4, 4096, 16, 128) causal, each kernel alone, steady clock: the Gluon dQ
#: kernel of then 539 against 515 TFLOP/s in grid order (the Triton dQ kernel 523 / 505), the
#: Gluon dK/dV kernel of then 513 / 497; at S 8192 593 / 580 and 561 / 551 (RESULTS.md,
#: fifteenth session).
_DQ_HEAD_GROUP = 8
_BWD_HEAD_GROUP = 8
#: The Gluon backward (``flash_attention_bwd_gluon_kernel``: dQ, dK and dV in one kernel, five
#: matmuls a step as FlashAttention-3's) by head dim: query rows a step and ring slots for Q
#: and dO (128 keys a program, two consumers of 64). It serves the plain case on a Hopper GPU
#: with Gluon whatever the config (``_gluon_bwd_applies``). H100, (4, 4096, 16, 128) causal,
#: profiler: 1.461 ms against 1.714 for the Gluon dK/dV and dQ kernels it replaced and 2.117
#: for the warp-specialized Triton ones; S 8192 (B 2): 2.729 / 3.185 / 3.902 (RESULTS.md,
#: sixteenth session). The step sizes are the dK/dV kernel's of the twelfth session: D 128, 64
#: rows: 525 / 603 TFLOP/s causal / not (a third slot 486 / 565, 128 rows 327 / 328); D 64,
#: 128 rows: 324 / 462 (64 rows 308 / 387).
_GLUON_BWD = {
    64: BwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2),
    128: BwdParams(q_blocksize=64, kv_blocksize=128, num_warps=4, num_stages=2),
}
#: Causal forward: the programs of 16 heads at a time, longest query blocks first (H100, D 64:
#: 308 against 292 TFLOP/s in grid order, D 128 (the usual kernel) 378 against 348).
_FWD_HEAD_GROUP = 16
_FWD_D128 = FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)
#: The usual forward at D 64, not causal, where the scale rides in the exponent: 128 query rows
#: and 8 warps. H100, (8, 2048, 16, 64): 385 / 386 / 392 against 384 / 376 / 381 TFLOP/s for
#: the above in three runs; causal it is 23 % slower (RESULTS.md, seventeenth session).
_FWD_D64_PLAIN = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
_BWD_D128 = BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=2)
#: The usual kernels' dK/dV under a causal mask at D 128: 32 query rows a step, 406 against
#: 323 TFLOP/s for 64 (non-causal 414 against 467; the eleventh session's sweep).
_BWD_D128_CAUSAL = BwdParams(q_blocksize=32, kv_blocksize=64, num_warps=4, num_stages=2)
#: D 64: dK/dV 394 against 357 TFLOP/s with a third stage; causal, 128 query rows a step and
#: no pipelining 270 against 251 (a third stage there: 229); dQ with a third stage 537 / 443
#: against 468 / 389 (non-causal / causal). At D 128 the third stage loses in both kernels.
_BWD_D64 = BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)
_BWD_D64_CAUSAL = BwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4, num_stages=1)
_DQ_D64 = FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)


def _plain_scale(a: Any) -> bool:
    """Whether the usual forward folds the scale into the exponent for these arguments on
    whole key blocks (``PLAIN_SCALE``: nothing to add or mask, no soft cap, a scale ≥ 0)."""
    extras = ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids", "logits_soft_cap")
    scale = a.get("softmax_scale")
    return all(a.get(name) is None for name in extras) and (scale is None or scale >= 0)


def _ws_candidate(a: Any) -> bool:
    """Whether the warp-specialized kernels would serve these arguments on this GPU (the
    heuristic's and the config space's question; :func:`_ws_applies` is the launch's)."""
    extras = ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids", "softmax_aux")
    return (
        all(a.get(name) is None for name in (*extras, "sliding_window"))
        and _ws_shapes(a["query"], a["value"])
        and not _launch.interpreting()
        and _compute_capability()[0] == 9
    )


def _ws_shapes(q: Any, v: Any) -> bool:
    """Head dims and dtypes the warp-specialized kernels take."""
    d = q.shape[-1]
    return d == v.shape[-1] and d in (64, 128) and q.dtype in (jnp.bfloat16, jnp.float16)


def _ws_params(given: Any, validated: Any) -> Any:
    """The block sizes a warp-specialized kernel runs with: on a GPU its validated config (other
    block sizes and stage counts compiled to wrong results, triton 3.6), in the interpreter the
    config's (the tests use small blocks, so that loops cross several blocks)."""
    if not _launch.interpreting():
        return validated
    return attrs.evolve(
        validated,
        q_blocksize=given.q_blocksize or validated.q_blocksize,
        kv_blocksize=given.kv_blocksize or validated.kv_blocksize,
    )


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic, then the forward and backward variants that ranked near the top of a
    sweep on the H100 (benchmarks/triton_tune.py), minus those over the device's shared
    memory. Kept small (about ten candidates) so a cold start tunes in well under a minute."""
    base = heuristic(inv)
    q, v = inv.kwargs["query"], inv.kwargs["value"]
    if _launch.interpreting() or q.dtype == jnp.float32:
        return [base]
    d, dv = _pow2(q.shape[-1]), _pow2(v.shape[-1])
    size = jnp.dtype(q.dtype).itemsize
    limit = _shared_memory_limit()
    fwd_blocks = (
        (128, 128, 8, 3),
        (128, 64, 8, 4),
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 8, 3),
    )
    bwd_blocks = ((64, 64, 4, 2), (32, 64, 4, 2), (128, 64, 4, 1), (64, 64, 4, 3))
    dq_blocks = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3))
    configs = [base]
    configs += [
        attrs.evolve(
            base,
            fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s),
            warp_specialize=False,
        )
        for bq, bk, w, s in fwd_blocks
        if _fwd_smem(bq, bk, s, d, dv, size) <= limit
    ]
    if _ws_candidate(inv.kwargs):  # Hopper, the plain case
        configs.append(attrs.evolve(base, fwd_params=_WS_FWD, warp_specialize=True))
    # the backward variants run the usual kernels (under warp_specialize a GPU runs the
    # validated configs, whatever bwd_params/dq_params say); with Gluon the plain case's dK/dV
    # (and, but at D 64 causal, dQ) are the Gluon kernel's whatever the config: no variants
    usual = attrs.evolve(base, fwd_params=_FWD_D128, warp_specialize=False)
    usual = usual if base.warp_specialize else base
    gluon = _ws_candidate(inv.kwargs) and _gluon_available()
    if not gluon:
        configs += [
            attrs.evolve(
                usual,
                bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s),
            )
            for bq, bk, w, s in bwd_blocks
            if _bwd_smem(bq, bk, s, d, dv, size) <= limit
        ]
    if not (gluon and _gluon_fuses_dq(q.shape[-1], bool(inv.kwargs.get("causal")))):
        configs += [
            attrs.evolve(
                usual,
                dq_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s),
            )
            for bq, bk, w, s in dq_blocks
            if _bwd_smem(bk, bq, s, d, dv, size) <= limit
        ]
    return list(dict.fromkeys(configs))


def _fwd_smem(bq: int, bk: int, stages: int, d: int, dv: int, size: int) -> int:
    return (bq * d + stages * bk * (d + dv)) * size


def _fit_stages(stages: int, smem_of: Any, tile: int, bias: jax.Array, mask: jax.Array) -> int:
    """``stages``, fewer while the shared memory they need exceeds the device's: ``smem_of(n)``
    for the q/k/v tiles plus, per extra stage, the bias and mask tiles of ``tile`` scores (an
    upper estimate, checked against the compiler's figure by tests/triton/test_codegen.py)."""
    extra = tile * (bias.dtype.itemsize if bias.ndim == 4 else 0) + tile * (mask.ndim == 4)
    while stages > 1 and smem_of(stages) + (stages - 1) * extra > _shared_memory_limit():
        stages -= 1
    return stages


def _bwd_smem(bq: int, bk: int, stages: int, d: int, dv: int, size: int) -> int:
    return (bk * (d + dv) + stages * bq * (d + dv)) * size + bq * bk * 4


#: Shared memory per block (opt-in maximum) by compute capability; unknown GPUs get the least.
_SHARED_MEMORY = {(8, 0): 166912, (8, 7): 166912, (9, 0): 232448, (10, 0): 232448}
_SHARED_MEMORY_DEFAULT = 101376  # sm_86, sm_89, sm_120


@functools.cache
def _shared_memory_limit() -> int:
    """From the device's compute capability (asking Triton's driver would import PyTorch,
    seconds of every process's start where it is installed)."""
    cc = _compute_capability()
    if cc == (0, 0):  # not a CUDA device (the interpreter): assume Hopper's 227 KiB
        return _SHARED_MEMORY[9, 0]
    return _SHARED_MEMORY.get(cc, _SHARED_MEMORY_DEFAULT)


@functools.cache
def _compute_capability() -> tuple[int, int]:
    """The default device's compute capability; ``(0, 0)`` when it is not a CUDA GPU."""
    try:
        major, minor = (int(x) for x in str(jax.devices()[0].compute_capability).split("."))
    except Exception:
        return 0, 0
    return major, minor


def _persistent_programs() -> int:
    """Programs of a persistent launch: one per SM on a GPU; in the interpreter a few, so the
    tests' tile loops take several turns."""
    return 3 if _launch.interpreting() else _sm_count()


@functools.cache
def _sm_count() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def _pow2_factor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n``, at most ``cap``."""
    return min(n & -n, cap)


def _clamp(block: int, seq: int) -> int:
    return max(16, min(block, _pow2(seq)))


# -- the op ---------------------------------------------------------------------------------


def flash_attention_triton(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: jax.Array | None = None,
    cfg: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Exact attention through the Triton kernels (arguments as validated by the core spec).

    Args:
        query: [B, Sq, Hq, D].
        key: [B, Sk, Hkv, D].
        value: [B, Sk, Hkv, Dv].
        bias: broadcastable to [B, Hq, Sq, Sk], added to the (soft-capped) logits.
        attention_mask: bool, broadcastable to [B, Hq, Sq, Sk], True = may attend.
        q_segment_ids: [B, Sq] int; a query sees a key when ids are equal and non-negative.
        kv_segment_ids: [B, Sk] int.
        softmax_aux: [Hq] or [Hq, n] sink logits, in the softmax denominator only.
        softmax_scale: multiplies the logits (the spec fills in D ** -0.5).
        causal: bottom-right aligned causal mask.
        sliding_window: ``(left, right)`` or ``None``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before bias and masking, or ``None``.
        dropout_prob: must be 0 (:func:`supports` declines dropout).
        dropout_seed: unused.
        cfg: block sizes, warps and stages; ``None`` takes the heuristic's.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    out, _ = _flash_attention_fwd(**locals())
    return out


def _flash_attention_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: jax.Array | None = None,
    cfg: FlashAttentionConfig | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """Forward: ``(out, residuals)``; residuals are the inputs, the output and the lse."""
    del dropout_seed
    if dropout_prob:
        raise ValueError("flash_attention (triton): dropout is not supported; use the xla platform")
    st = _Statics.of(query, key, value, softmax_scale, causal, sliding_window, logits_soft_cap, cfg)
    arrays = _Arrays.of(
        query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux
    )
    out, lse = _forward_call(st, arrays.modes())(*arrays.launch_args())
    return out, {"arrays": arrays, "out": out, "lse": lse}


def _flash_attention_bwd(
    residuals: dict[str, Any],
    d_out: jax.Array,
    *,
    cfg: FlashAttentionConfig | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
) -> dict[str, jax.Array | None]:
    """Backward: gradients of query, key, value, bias (its own shape) and softmax_aux."""
    del dropout_prob
    arrays: _Arrays = residuals["arrays"]
    out, lse = residuals["out"], residuals["lse"]
    st = _Statics.of(
        arrays.query,
        arrays.key,
        arrays.value,
        softmax_scale,
        causal,
        sliding_window,
        logits_soft_cap,
        cfg,
    )
    call = _backward_call(st, arrays.modes())
    dq, dk, dv, dbias, delta = call(*arrays.launch_args(), d_out, lse, out)
    grads: dict[str, jax.Array | None] = {"query": dq, "key": dk, "value": dv}
    grads["bias"] = arrays.bias_gradient(dbias)
    grads["softmax_aux"] = arrays.aux_gradient(lse, delta)
    return grads


defvjp(flash_attention_triton, _flash_attention_fwd, _flash_attention_bwd)


def scaled_dot_product_attention_triton(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    cfg: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Scaled dot-product attention: :func:`flash_attention_triton` without dropout and sinks."""
    out, _ = _flash_attention_fwd(**locals())
    return out


def _sdpa_bwd(residuals: dict[str, Any], d_out: jax.Array, **statics: Any) -> dict[str, Any]:
    grads = _flash_attention_bwd(residuals, d_out, **statics)
    grads.pop("softmax_aux")
    return grads


defvjp(scaled_dot_product_attention_triton, _flash_attention_fwd, _sdpa_bwd)


# -- argument layout ------------------------------------------------------------------------


@attrs.frozen
class _Statics:
    """What the kernels take as scalars and constexprs, from the call and its config."""

    sm_scale: float
    soft_cap: float | None
    causal: bool
    window: tuple[int, int] | None
    fwd: FwdParams
    bwd: BwdParams
    dq: FwdParams
    precision: str
    warp_specialize: bool = False

    @classmethod
    def of(
        cls,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        softmax_scale: float | None,
        causal: bool,
        sliding_window: tuple[int, int] | None,
        logits_soft_cap: float | None,
        cfg: FlashAttentionConfig | None,
    ) -> _Statics:
        if cfg is None:
            cfg = _default_config(query, key, value, causal)
        fwd, bwd = cfg.fwd_params, cfg.bwd_params
        dq = cfg.dq_params or FwdParams(
            q_blocksize=bwd.kv_blocksize,
            kv_blocksize=bwd.q_blocksize,
            num_warps=bwd.num_warps,
            num_stages=bwd.num_stages,
        )
        scale = query.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        return cls(
            sm_scale=scale,
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            causal=bool(causal),
            window=None if sliding_window is None else tuple(int(w) for w in sliding_window),
            fwd=fwd,
            bwd=bwd,
            dq=dq,
            precision="ieee" if query.dtype == jnp.float32 else "tf32",
            warp_specialize=cfg.warp_specialize,
        )


def _default_config(
    query: jax.Array, key: jax.Array, value: jax.Array, causal: bool = False
) -> FlashAttentionConfig:
    # the heuristic reads only the shapes and dtypes of these arguments, and causal
    inv = types.SimpleNamespace(
        kwargs={"query": query, "key": key, "value": value, "causal": causal}
    )
    return heuristic(inv)


@jax.tree_util.register_pytree_node_class
@attrs.frozen
class _Arrays:
    """The array inputs as the kernels take them: bias/mask 4-D, sinks ``[Hq, n]`` float32."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    aux: jax.Array | None
    bias_shape: tuple[int, ...] | None = None
    aux_shape: tuple[int, ...] | None = None
    aux_dtype: Any = None

    @classmethod
    def of(cls, query, key, value, bias, mask, q_seg, kv_seg, aux) -> _Arrays:
        return cls(
            query,
            key,
            value,
            None if bias is None else _as_4d(bias),
            None if mask is None else _as_4d(mask).astype(jnp.int8),
            None if q_seg is None else q_seg.astype(jnp.int32),
            None if kv_seg is None else kv_seg.astype(jnp.int32),
            None if aux is None else aux.astype(jnp.float32).reshape(query.shape[2], -1),
            None if bias is None else tuple(bias.shape),
            None if aux is None else tuple(aux.shape),
            None if aux is None else aux.dtype,
        )

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children = (
            self.query,
            self.key,
            self.value,
            self.bias,
            self.mask,
            self.q_segment_ids,
            self.kv_segment_ids,
            self.aux,
        )
        return children, (self.bias_shape, self.aux_shape, self.aux_dtype)

    @classmethod
    def tree_unflatten(cls, aux_data: tuple[Any, ...], children: tuple[Any, ...]) -> _Arrays:
        return cls(*children, *aux_data)

    def launch_args(self) -> tuple[jax.Array, ...]:
        """The eight array inputs of the kernels; absent ones are 1-element placeholders."""
        return (
            self.query,
            self.key,
            self.value,
            _or_placeholder(self.bias, self.query.dtype),
            _or_placeholder(self.mask, jnp.int8),
            _or_placeholder(self.q_segment_ids, jnp.int32),
            _or_placeholder(self.kv_segment_ids, jnp.int32),
            _or_placeholder(self.aux, jnp.float32),
        )

    def modes(self) -> tuple[str, ...]:
        """How :func:`fold_vmap` folds each launch argument (placeholders never fold)."""
        present = (
            True,
            True,
            True,
            self.bias is not None,
            self.mask is not None,
            self.q_segment_ids is not None,
            self.kv_segment_ids is not None,
            False,
        )
        kinds = (BATCH, BATCH, BATCH, BROADCAST, BROADCAST, BATCH, BATCH, OTHER)
        return tuple(k if p else OTHER for k, p in zip(kinds, present, strict=True))

    def bias_gradient(self, dbias: jax.Array) -> jax.Array | None:
        """Sum the ``[B, Hq, Sq, Sk]`` logit gradient into the bias's own shape and dtype."""
        if self.bias is None:
            return None
        axes = tuple(i for i, n in enumerate(self.bias.shape) if n == 1 and dbias.shape[i] != 1)
        g = jnp.sum(dbias, axis=axes, keepdims=True)
        return g.reshape(self.bias_shape).astype(self.bias.dtype)

    def aux_gradient(self, lse: jax.Array, delta: jax.Array) -> jax.Array | None:
        """``d aux[h, j] = -Σ_{b, i} exp(aux[h, j] - lse[b, h, i]) · delta[b, h, i]``."""
        if self.aux is None:
            return None
        lse_nat = lse / _LOG2E
        p = jnp.exp(self.aux[None, :, None, :] - lse_nat[..., None])  # [B, Hq, Sq, n]
        g = -jnp.einsum("bhin,bhi->hn", p, delta)
        return g.reshape(self.aux_shape).astype(self.aux_dtype)


def _as_4d(x: jax.Array) -> jax.Array:
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def _or_placeholder(x: jax.Array | None, dtype: Any) -> jax.Array:
    return jnp.zeros((1,), dtype) if x is None else x


def _strides(shape: tuple[int, ...], align: int) -> list[int]:
    """Row-major strides of the three leading axes of a [B, S, H, D] array, in units of
    ``align`` elements (the kernels multiply them back by their constexpr ``ALIGN``)."""
    return [int(np.prod(shape[i + 1 :])) // align for i in range(3)]


def _broadcast_strides(x: jax.Array) -> list[int]:
    """Row-major strides of a 4-D bias/mask, 0 along size-1 axes (read as broadcast)."""
    if x.ndim != 4:  # placeholder
        return [0, 0, 0, 0]
    strides, step = [], 1
    for n in reversed(x.shape):
        strides.append(step if n != 1 else 0)
        step *= n
    return strides[::-1]


def _common(
    st: _Statics, q: jax.Array, v: jax.Array, bias: jax.Array, mask: jax.Array, qseg: jax.Array
) -> tuple[list[Any], dict[str, Any]]:
    """Scalars shared by the kernels (after the arrays) and their constexprs."""
    _, sq, hq, d = q.shape
    _, sk, hkv, dv = v.shape
    left, right = st.window or (0, 0)
    # floats as np.float32: jax-triton would pass a Python float as fp64
    scalars = [
        np.float32(st.sm_scale),
        np.float32(st.soft_cap or 1.0),
        sq,
        sk,
        hq,
        hkv,
        left,
        right,
    ]
    constexprs = {
        "HEAD_DIM": d,
        "HEAD_DIM_V": dv,
        "BLOCK_D": _pow2(d),
        "BLOCK_DV": _pow2(dv),
        "CAUSAL": st.causal,
        "WINDOW": st.window is not None,
        "SOFT_CAP": st.soft_cap is not None,
        "HAS_BIAS": bias.ndim == 4,
        "HAS_MASK": mask.ndim == 4,
        "HAS_SEG": qseg.ndim == 2,
        "DOT_PRECISION": st.precision,
        # every q/k/v/o/dO stride is a multiple of gcd(D, Dv): say so, up to 16 elements
        "ALIGN": _pow2_factor(math.gcd(d, dv), 16),
    }
    return scalars, constexprs


def _forward_call(st: _Statics, modes: tuple[str, ...]) -> Any:
    def run(q, k, v, bias, mask, qseg, kseg, aux):
        from ejkernel_triton.kernels.flash_attention_fwd import flash_attention_fwd_kernel

        if st.warp_specialize and _ws_applies(st, q, v, bias, mask, qseg, aux):
            return tuple(_forward_ws(st, q, k, v))
        b, sq, hq, _ = q.shape
        dv = v.shape[-1]
        scalars, constexprs = _common(st, q, v, bias, mask, qseg)
        has_aux = aux.ndim == 2
        num_aux = aux.shape[1] if has_aux else 1
        # causal: longest query blocks first, heads in groups (RESULTS.md, eleventh session)
        head_group = _FWD_HEAD_GROUP if st.causal else 0
        plain = not any(constexprs[f] for f in ("SOFT_CAP", "HAS_BIAS", "HAS_MASK", "HAS_SEG"))
        constexprs.update(
            HAS_AUX=has_aux,
            BLOCK_AUX=_pow2(num_aux),
            HEAD_GROUP=head_group,
            PLAIN_SCALE=_SCALE_IN_EXP and plain and st.sm_scale >= 0,
        )
        bq, bk = (
            _clamp(st.fwd.q_blocksize or 128, sq),
            _clamp(st.fwd.kv_blocksize or 64, k.shape[1]),
        )
        out, lse = _launch.launch(
            flash_attention_fwd_kernel,
            q,
            k,
            v,
            bias,
            mask,
            qseg,
            kseg,
            aux,
            *scalars,
            num_aux,
            *_strides(q.shape, constexprs["ALIGN"]),
            *_strides(k.shape, constexprs["ALIGN"]),
            *_strides(v.shape, constexprs["ALIGN"]),
            *_strides((b, sq, hq, dv), constexprs["ALIGN"]),
            *_broadcast_strides(bias),
            *_broadcast_strides(mask),
            out_shape=[
                jax.ShapeDtypeStruct((b, sq, hq, dv), q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
            ],
            grid=(_cdiv(sq, bq), b * hq),
            num_warps=st.fwd.num_warps or 4,
            num_stages=_fit_stages(
                st.fwd.num_stages or 2,
                lambda n: _fwd_smem(bq, bk, n, _pow2(q.shape[-1]), _pow2(dv), q.dtype.itemsize),
                bq * bk,
                bias,
                mask,
            ),
            BLOCK_M=bq,
            BLOCK_N=bk,
            **constexprs,
        )
        return out, lse

    return _launch.fold_vmap(run, modes)


def _gluon_bwd_applies(st: _Statics, q, v, bias, mask, qseg, aux) -> bool:
    """Whether ``flash_attention_bwd_gluon_kernel`` serves this backward: the plain case
    of the warp-specialized kernels, on a Hopper GPU with Gluon."""
    return (
        _ws_applies(st, q, v, bias, mask, qseg, aux)
        and not _launch.interpreting()
        and _gluon_available()
    )


def _gluon_fuses_dq(d: int, causal: bool) -> bool:
    """Whether the Gluon backward computes dQ too (else the usual dQ kernel does, first, with
    delta): everywhere but D 64 causal. H100, fwd+bwd TFLOP/s fused / Gluon dK/dV with a
    separate dQ kernel: D 128 (4, 4096, 16) 431 / 396 causal, 480 / 465 not; D 64 (8, 2048,
    16) 357 / 351 not, but 257 / 279 causal (RESULTS.md, sixteenth session)."""
    return not (d == 64 and causal)


def _ws_applies(st: _Statics, q, v, bias, mask, qseg, aux) -> bool:
    """Whether the warp-specialized kernels serve this launch (see ``FlashAttentionConfig``)."""
    plain = bias.ndim != 4 and mask.ndim != 4 and qseg.ndim != 2 and aux.ndim != 2
    return (
        plain
        and st.window is None
        and _ws_shapes(q, v)
        and (_launch.interpreting() or _compute_capability()[0] == 9)
    )


def _ws_launch(
    st: _Statics,
    kernel: Any,
    arrays: tuple[jax.Array, ...],
    out_shape: list[jax.ShapeDtypeStruct],
    grid: tuple[int, ...],
    params: Any,
    *extra: int,
    zeroed_outputs: tuple[int, ...] = (),
    **constexprs: Any,
) -> list[Any]:
    """Launch a warp-specialized kernel: its arrays, the scalars all three take (scale, soft
    cap, B, Sq, Sk, Hq, Hkv), ``extra`` ones, its outputs (those of ``zeroed_outputs`` set to
    zero first) and the per-program scratch its TMA descriptors live in (dropped from the
    result)."""
    from ejkernel_triton._kernel_cache import GLOBAL_SCRATCH_BYTES

    q, k = arrays[0], arrays[1]
    (b, sq, hq, d), (sk, hkv) = q.shape, k.shape[1:3]
    *outs, _ = _launch.launch(
        kernel,
        *arrays,
        np.float32(st.sm_scale),
        np.float32(st.soft_cap or 1.0),
        b,
        sq,
        sk,
        hq,
        hkv,
        *extra,
        out_shape=[
            *out_shape,
            jax.ShapeDtypeStruct((math.prod(grid) * GLOBAL_SCRATCH_BYTES,), jnp.int8),
        ],
        grid=grid,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
        zeroed_outputs=zeroed_outputs,
        HEAD_DIM=d,
        CAUSAL=st.causal,
        SOFT_CAP=st.soft_cap is not None,
        **constexprs,
    )
    return outs


def _forward_ws(st: _Statics, q: jax.Array, k: jax.Array, v: jax.Array) -> list[Any]:
    """Output and lse by ``flash_attention_fwd_pingpong_kernel`` where it applies (a GPU, D
    128, a scale > 0: it masks and takes row maxima before scaling), else by
    ``flash_attention_fwd_ws_kernel`` (blocks by :func:`_ws_params`)."""
    from ejkernel_triton.kernels.flash_attention_fwd import flash_attention_fwd_ws_kernel

    (b, sq, hq, d), sk = q.shape, k.shape[1]
    if d == 128 and st.sm_scale > 0 and not _launch.interpreting() and _gluon_available():
        return _forward_pingpong(st, q, k, v)
    params = _ws_params(st.fwd, _WS_FWD)
    bq, bk = _clamp(params.q_blocksize, sq), _clamp(params.kv_blocksize, sk)
    return _ws_launch(
        st,
        flash_attention_fwd_ws_kernel,
        (q, k, v),
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)],
        (min(_cdiv(sq, bq) * b * hq, _persistent_programs()),),
        params,
        BLOCK_M=bq,
        BLOCK_N=bk,
        EVEN_K=sk % bk == 0,
    )


def _forward_pingpong(st: _Statics, q: jax.Array, k: jax.Array, v: jax.Array) -> list[Any]:
    """Output and lse by the Gluon kernel ``flash_attention_fwd_pingpong_kernel`` (FA3's
    schedule; the GPU only): one program per 128-row query tile and batch·head."""
    from ejkernel_triton.kernels.flash_attention_hopper_fwd import (
        flash_attention_fwd_pingpong_kernel,
    )

    (b, sq, hq, _), sk = q.shape, k.shape[1]
    params = _PINGPONG_FWD
    return _ws_launch(
        st,
        flash_attention_fwd_pingpong_kernel,
        (q, k, v),
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)],
        (_cdiv(sq, params.q_blocksize), b * hq),
        params,
        BLOCK_N=params.kv_blocksize,
        STAGES=params.num_stages,
        EVEN_K=sk % params.kv_blocksize == 0,
        HEAD_GROUP=_PINGPONG_HEAD_GROUP if st.causal else 0,
    )


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper API (triton 3.6 has)."""
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def _dkdv_ws(st: _Statics, q, k, v, do, lse, delta) -> list[Any]:
    """dK and dV by ``flash_attention_bwd_dkdv_ws_kernel`` (blocks by :func:`_ws_params`)."""
    from ejkernel_triton.kernels.flash_attention_bwd import flash_attention_bwd_dkdv_ws_kernel

    sq, (b, sk, hkv, _) = q.shape[1], k.shape
    params = _ws_params(st.bwd, _WS_DKDV)
    bq, bk = _clamp(params.q_blocksize, sq), _clamp(params.kv_blocksize, sk)
    return _ws_launch(
        st,
        flash_attention_bwd_dkdv_ws_kernel,
        (q, k, v, do, lse, delta),
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        (_cdiv(sk, bk), b * hkv),
        params,
        BLOCK_M=bq,
        BLOCK_N=bk,
    )


def _bwd_gluon(st: _Statics, q, k, v, do, lse, delta, fuse_dq: bool = True) -> Any:
    """``(dQ, dK, dV)`` by the Gluon kernel ``flash_attention_bwd_gluon_kernel`` (the GPU only):
    one program per 128 keys and batch·key head; lse and delta padded to whole query blocks
    (the loader brings them by TMA); dQ accumulates in float32 across the key blocks' programs
    (TMA reduce-adds) and is scaled and cast here. Without ``fuse_dq`` only dK and dV (dQ is
    ``None``)."""
    from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE
    from ejkernel_triton.kernels.flash_attention_hopper_bwd import flash_attention_bwd_gluon_kernel

    sq, (b, sk, hkv, d) = q.shape[1], k.shape
    params = _GLUON_BWD[d]
    bm = params.q_blocksize
    stats_len = _cdiv(sq, bm) * bm
    if stats_len != sq:
        pad = ((0, 0), (0, 0), (0, stats_len - sq))
        lse = jnp.pad(lse, pad, constant_values=EMPTY_LSE.value)
        delta = jnp.pad(delta, pad)
    dk, dv, dq = _ws_launch(
        st,
        flash_attention_bwd_gluon_kernel,
        (q, k, v, do, lse, delta),
        [
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(q.shape if fuse_dq else (1,), jnp.float32),
        ],
        (_cdiv(sk, 128), b * hkv),
        params,
        stats_len,
        zeroed_outputs=(2,) if fuse_dq else (),
        BLOCK_M=bm,
        STAGES=params.num_stages,
        HEAD_GROUP=_BWD_HEAD_GROUP if st.causal else 0,
        FUSE_DQ=fuse_dq,
    )
    return ((dq * st.sm_scale).astype(q.dtype) if fuse_dq else None), dk, dv


def _dq_ws(st: _Statics, q, k, v, do, lse, delta) -> Any:
    """dQ by ``flash_attention_bwd_dq_ws_kernel`` (blocks by :func:`_ws_params`)."""
    from ejkernel_triton.kernels.flash_attention_bwd import flash_attention_bwd_dq_ws_kernel
    from ejkernel_triton.kernels.flash_attention_common import EMPTY_LSE

    (b, sq, hq, _), sk = q.shape, k.shape[1]
    params = _ws_params(st.dq, _WS_DQ)
    bq, bk = _clamp(params.q_blocksize, sq), _clamp(params.kv_blocksize, sk)
    blocks = _cdiv(sq, bq)
    if blocks * bq != sq:  # whole blocks of row statistics
        pad = ((0, 0), (0, 0), (0, blocks * bq - sq))
        lse = jnp.pad(lse, pad, constant_values=EMPTY_LSE.value)
        delta = jnp.pad(delta, pad)
    (dq,) = _ws_launch(
        st,
        flash_attention_bwd_dq_ws_kernel,
        (q, k, v, do, lse, delta),
        [jax.ShapeDtypeStruct(q.shape, q.dtype)],
        (blocks, b * hq),
        params,
        blocks * bq,
        BLOCK_M=bq,
        BLOCK_N=bk,
        EVEN_K=sk % bk == 0,
        HEAD_GROUP=_DQ_HEAD_GROUP if st.causal else 0,
    )
    return dq


def _backward_call(st: _Statics, modes: tuple[str, ...]) -> Any:
    """``run(arrays..., dO, lse, out) -> (dQ, dK, dV, dBias, delta)``; delta
    (``rowsum(out ∘ dO)``, ``[B, Hq, Sq]``) comes out for the sinks' gradient."""

    def run(q, k, v, bias, mask, qseg, kseg, aux, do, lse, out):
        from ejkernel_triton.kernels.flash_attention_bwd import (
            flash_attention_bwd_dkdv_kernel,
            flash_attention_bwd_dq_kernel,
        )

        do = do.astype(q.dtype)
        gluon = _gluon_bwd_applies(st, q, v, bias, mask, qseg, aux)
        fused = gluon and _gluon_fuses_dq(q.shape[-1], st.causal)
        ws = not gluon and st.warp_specialize and _ws_applies(st, q, v, bias, mask, qseg, aux)
        if fused or ws:
            delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
            if fused:
                dq, dk, dv = _bwd_gluon(st, q, k, v, do, lse, delta)
            else:
                dk, dv = _dkdv_ws(st, q, k, v, do, lse, delta)
                dq = _dq_ws(st, q, k, v, do, lse, delta)
            return dq, dk, dv, jnp.zeros((1,), jnp.float32), delta
        del aux
        b, sq, hq, _ = q.shape
        _, sk, hkv, _ = k.shape
        scalars, constexprs = _common(st, q, v, bias, mask, qseg)

        def args(rows):  # the arrays and scalars of both kernels; ``rows``: out or delta
            return (
                q,
                k,
                v,
                bias,
                mask,
                qseg,
                kseg,
                do,
                lse,
                rows,
                *scalars,
                *_strides(q.shape, constexprs["ALIGN"]),
                *_strides(k.shape, constexprs["ALIGN"]),
                *_strides(v.shape, constexprs["ALIGN"]),
                *_strides(do.shape, constexprs["ALIGN"]),
                *_broadcast_strides(bias),
                *_broadcast_strides(mask),
            )

        d_pow2, dv_pow2 = _pow2(q.shape[-1]), _pow2(v.shape[-1])
        # dQ first: it computes delta for the dK/dV kernel
        has_bias = bias.ndim == 4
        qb, kb = _clamp(st.dq.q_blocksize or 128, sq), _clamp(st.dq.kv_blocksize or 32, sk)
        dq, dbias, delta = _launch.launch(
            flash_attention_bwd_dq_kernel,
            *args(out),
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq, sk) if has_bias else (1,), jnp.float32),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
            ],
            grid=(_cdiv(sq, qb), b * hq),
            num_warps=st.dq.num_warps or 4,
            num_stages=_fit_stages(
                st.dq.num_stages or 2,
                lambda n: _bwd_smem(kb, qb, n, d_pow2, dv_pow2, q.dtype.itemsize),
                qb * kb,
                bias,
                mask,
            ),
            zeroed_outputs=(1,),
            BLOCK_M=qb,
            BLOCK_N=kb,
            **constexprs,
        )
        if gluon:  # the Gluon kernel does not fuse dQ here (_gluon_fuses_dq): dK, dV alone
            _, dk, dv = _bwd_gluon(st, q, k, v, do, lse, delta, fuse_dq=False)
            return dq, dk, dv, dbias, delta
        bq, bk = _clamp(st.bwd.q_blocksize or 32, sq), _clamp(st.bwd.kv_blocksize or 128, sk)
        dk, dv = _launch.launch(
            flash_attention_bwd_dkdv_kernel,
            *args(delta),
            out_shape=[
                jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
            ],
            grid=(_cdiv(sk, bk), b * hkv),
            num_warps=st.bwd.num_warps or 4,
            num_stages=_fit_stages(
                st.bwd.num_stages or 2,
                lambda n: _bwd_smem(bq, bk, n, d_pow2, dv_pow2, q.dtype.itemsize),
                bq * bk,
                bias,
                mask,
            ),
            BLOCK_M=bq,
            BLOCK_N=bk,
            **constexprs,
        )
        return dq, dk, dv, dbias, delta

    return _launch.fold_vmap(run, (*modes, BATCH, BATCH, BATCH))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
