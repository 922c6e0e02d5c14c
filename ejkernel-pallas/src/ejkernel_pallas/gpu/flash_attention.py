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

Declined in ``supports()`` (the XLA plugin serves them): everything but bf16/f16 inputs; head
dims other than 64/128 or ``Dv != D``; sequence lengths that are not multiples of 128;
sliding window, soft cap, segment ids, bias, masks, sinks, dropout; GPUs older than Hopper.

What was verified how: the kernels run on the CPU in Mosaic GPU's interpret mode (jax >= 0.10:
warpgroups, barriers, TMA copies and shared memory simulated) in ``tests/pallas/
test_flash_attention_gpu.py``, where the ``wgmma`` calls are replaced by ``jnp.dot`` on the same
shared-memory tiles (the interpreter does not model WGMMA accumulators): the pipelines,
mbarriers, masks and softmax are the ones that run on the GPU (the consumers' named-barrier
ping-pong only orders work, and is skipped there). The real lowering is exercised by
the ``gpu``-marked tests and ``benchmarks/bench_pallas_gpu.py`` on an H100.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel import _env
from ejkernel._params import BwdParams, FwdParams
from ejkernel.plugins import defvjp
from ejkernel_pallas import _compat
from ejkernel_pallas._attention import FlashAttentionConfig, declined_features

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_pallas",
    "heuristic",
    "scaled_dot_product_attention_pallas",
    "supports",
]

LOG2E = math.log2(math.e)
#: Initial running maximum (base-2 logits): finite, so ``exp2(m_old - m_new)`` is never NaN.
M_INIT = -1e30
#: Base-2 logsumexp of a row with no visible key: ``exp2(s - it)`` is 0.
EMPTY_ROW_LSE = 1e30
#: D 256 is declined: the backward's K, V and the Q/dO ring of two 64-row tiles need 256 KiB of
#: shared memory, over the H100's 227 KiB.
HEAD_DIMS = (64, 128)
SEQ_MULTIPLE = 128
DTYPES = ("bfloat16", "float16")
#: Defaults per head dim: forward (bq per consumer, bk, stages), backward (bq, bk, stages).
FWD_DEFAULT = {64: (64, 128, 2), 128: (64, 128, 2)}
BWD_DEFAULT = {64: (64, 64, 2), 128: (64, 64, 2)}
#: Non-causal forwards at these head dims take kv tiles of 192 rows (FA3's choice of wide kv
#: tiles for D 128): fewer steps, so less per-step softmax and barrier overhead (on an H100
#: the D 128 forward runs about 3 % faster than with 128 rows). When 192 does not divide Sk,
#: the last one or two steps take :data:`TAIL_ROWS` rows (4096 = 20 · 192 + 2 · 128).
FWD_WIDE_KV = {128: 192}
#: Rows of the narrower kv steps that end a forward whose kv tile does not divide Sk.
TAIL_ROWS = 128
TUNING = ((64, 64, 2), (64, 128, 2), (64, 128, 3), (64, 64, 3))
#: Registers per thread of consumer and producer warpgroups (FA3's split of the 64K file).
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


def heuristic(inv: Any) -> FlashAttentionConfig:
    """FA3's blocks for the head dim (two consumers of 64 query rows, kv tiles of 64-128)."""
    d = inv.kwargs["query"].shape[3]
    fq, fk, fs = _fwd_defaults(d, bool(inv.kwargs.get("causal")))
    bq, bk, bs = BWD_DEFAULT.get(d, (64, 64, 2))
    return FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=fq, kv_blocksize=fk, num_stages=fs),
        bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_stages=bs),
    )


def _fwd_defaults(d: int, causal: bool) -> tuple[int, int, int]:
    bq, bk, stages = FWD_DEFAULT.get(d, (64, 64, 2))
    return bq, (bk if causal else FWD_WIDE_KV.get(d, bk)), stages


def _tail_steps(sk: int, bk: int) -> int | None:
    """Fewest :data:`TAIL_ROWS`-row steps after which ``bk``-row steps cover ``sk`` exactly."""
    for tail in range(bk // 64 + 1):
        rest = sk - tail * TAIL_ROWS
        if rest >= 0 and rest % bk == 0:
            return tail
    return None


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic's config, then a few (bq, bk, stages) triples for both passes."""
    configs = [heuristic(inv)]
    for bq, bk, stages in TUNING:
        cfg = FlashAttentionConfig(
            fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_stages=stages),
            bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_stages=stages),
        )
        if cfg not in configs:
            configs.append(cfg)
    return configs


def supports(inv: Any) -> bool | str:
    """True, or why these kernels cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    declined = declined_features(kw)
    if declined:
        return declined
    for name, why in (
        ("sliding_window", "a sliding window"),
        ("logits_soft_cap", "a logits soft cap"),
        ("q_segment_ids", "segment ids"),
    ):
        if kw.get(name) is not None:
            return f"the Pallas Mosaic GPU kernels do not implement {why}; XLA serves it"
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
    if not _env.interpret():
        cc = _compute_capability()
        if cc is not None and cc < (9, 0):
            return (
                f"the Pallas Mosaic GPU kernels need Hopper (sm_90+); this GPU is sm_{cc[0]}{cc[1]}"
            )
    return True


def _compute_capability() -> tuple[int, int] | None:
    try:
        dev = jax.devices()[0]
        major, minor = str(dev.compute_capability).split(".")
        return int(major), int(minor)
    except Exception:  # not a CUDA device (interpret mode, ROCm): say nothing
        return None


# --------------------------------------------------------------------------------------------
# The registered entry, its forward and backward
# --------------------------------------------------------------------------------------------


def flash_attention_pallas(
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
    """Flash attention on Mosaic GPU (arguments as validated by the core spec).

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
    out, _ = _flash_attention_fwd(**locals())
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
    _refuse(declined)
    pr = _Problem.of(query, key, cfg, backward=False, softmax_scale=softmax_scale, causal=causal)
    out, lse = _fwd_call(query, key, value, pr)
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
    pr = _Problem.of(q, k, cfg, backward=True, softmax_scale=softmax_scale, causal=causal)
    do = d_out.astype(q.dtype)
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", residuals["out"].astype(jnp.float32), do.astype(jnp.float32)
    )
    dq = _bwd_dq_call(q, k, v, do, residuals["lse"], delta, pr)
    dk, dv = _bwd_dkv_call(q, k, v, do, residuals["lse"], delta, pr)
    if pr.group > 1:  # per query head -> per kv head
        b, sk, hkv, d = k.shape
        dk = dk.reshape(b, sk, hkv, pr.group, d).sum(axis=3)
        dv = dv.reshape(b, sk, hkv, pr.group, d).sum(axis=3)
    return {"query": dq, "key": dk.astype(k.dtype), "value": dv.astype(v.dtype)}


defvjp(flash_attention_pallas, _flash_attention_fwd, _flash_attention_bwd)


def scaled_dot_product_attention_pallas(
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
    """Scaled dot-product attention: :func:`flash_attention_pallas` without dropout and sinks."""
    return flash_attention_pallas(**locals())


defvjp(scaled_dot_product_attention_pallas, _flash_attention_fwd, _flash_attention_bwd)


def _refuse(declined: dict[str, Any]) -> None:
    present = [
        k
        for k, v in declined.items()
        if v is not None and not (k == "dropout_prob" and float(v) == 0.0)
    ]
    if present:
        raise NotImplementedError(
            f"ejkernel_pallas Mosaic GPU flash attention: {present} are declined by supports(); "
            "select platform='xla' for them"
        )


# --------------------------------------------------------------------------------------------
# Problem geometry
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Problem:
    """Everything static about one launch."""

    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    bq: int
    bk: int
    stages: int
    scale: float
    causal: bool
    dtype: Any
    interpret: bool
    #: Non-causal forward only: steps of TAIL_ROWS rows ending the kv loop (bk ∤ Sk).
    tail: int = 0

    @classmethod
    def of(
        cls,
        query: jax.Array,
        key: jax.Array,
        cfg: FlashAttentionConfig | None,
        *,
        backward: bool,
        softmax_scale: float | None,
        causal: bool,
    ) -> _Problem:
        b, sq, hq, d = query.shape
        _, sk, hkv, _ = key.shape
        defaults = BWD_DEFAULT.get(d, (64, 64, 2)) if backward else _fwd_defaults(d, causal)
        params = None if cfg is None else (cfg.bwd_params if backward else cfg.fwd_params)
        bq = (params and params.q_blocksize) or defaults[0]
        bk = (params and params.kv_blocksize) or defaults[1]
        stages = (params and params.num_stages) or defaults[2]
        for name, blk in (("q_blocksize", bq), ("kv_blocksize", bk)):
            if blk % 64:
                raise ValueError(
                    f"flash_attention (pallas gpu): {name} must be a multiple of 64; got {blk}"
                )
        tail = 0
        if not backward and not causal and sk % bk:
            tail = _tail_steps(sk, bk)
        if sq % (2 * bq) or tail is None or (sk % (2 * bk if backward else bk) and not tail):
            raise ValueError(
                f"flash_attention (pallas gpu): Sq={sq} must be a multiple of 2·q_blocksize="
                f"{2 * bq} and Sk={sk} of kv_blocksize={bk}{' x 2' if backward else ''}"
                + ("" if backward or causal else f" (or of it plus {TAIL_ROWS}-row steps)")
            )
        return cls(
            b=b,
            sq=sq,
            sk=sk,
            hq=hq,
            hkv=hkv,
            d=d,
            bq=bq,
            bk=bk,
            stages=max(2, int(stages)),
            scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
            causal=bool(causal),
            dtype=jnp.dtype(query.dtype),
            interpret=jax.default_backend() == "cpu",
            tail=tail,
        )

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def offset(self) -> int:
        """Key position of query 0 (bottom-right alignment)."""
        return self.sk - self.sq

    @property
    def nk(self) -> int:
        """Kv steps: ``bk`` rows each, then ``tail`` steps of TAIL_ROWS rows."""
        return (self.sk - self.tail * TAIL_ROWS) // self.bk + self.tail

    @property
    def wide_steps(self) -> int:
        """Kv steps of ``bk`` rows (all of them unless there is a tail)."""
        return self.nk - self.tail

    @property
    def nq(self) -> int:
        return self.sq // self.bq

    @property
    def fwd_tiles(self) -> int:
        """Forward tiles (CTAs of the grid launch): (head, pair of query blocks, batch)."""
        return self.hq * (self.sq // (2 * self.bq)) * self.b

    def kv_steps(self, q0: Any) -> Any:
        """Kv blocks rows ``[q0, q0 + bq)`` see: keys ``< q0 + bq + offset`` when causal."""
        if not self.causal:
            return self.nk
        end = jnp.maximum(q0 + self.bq + self.offset, 0)
        return jnp.minimum(lax.div(end + self.bk - 1, jnp.int32(self.bk)), self.nk)

    def kv_full_steps(self, q0: Any, steps: Any) -> Any:
        """Leading kv blocks every row of ``[q0, q0 + bq)`` sees whole (no mask needed)."""
        if not self.causal:
            return steps
        seen = jnp.maximum(q0 + self.offset + 1, 0)
        return jnp.minimum(lax.div(seen, jnp.int32(self.bk)), steps)

    def q_start(self, k0: Any) -> Any:
        """First query block that sees keys ``[k0, k0 + bk)`` (causal; else 0)."""
        if not self.causal:
            return jnp.int32(0)
        first = jnp.maximum(k0 - self.offset, 0)
        return jnp.minimum(lax.div(first, jnp.int32(self.bq)), self.nq)

    def q_full_start(self, k0: Any, start: Any) -> Any:
        """First query block from which every (query, key) pair of the tile is visible."""
        if not self.causal:
            return start
        need = jnp.maximum(k0 + self.bk - 1 - self.offset, 0)
        return jnp.clip(lax.div(need + self.bq - 1, jnp.int32(self.bq)), start, self.nq)


# --------------------------------------------------------------------------------------------
# Matmul and load helpers: wgmma on the GPU, jnp.dot on the same tiles in interpret mode
# --------------------------------------------------------------------------------------------


def _value(x: Any, transpose: bool = False) -> Any:
    v = x[...] if _compat.is_ref(x) else x
    return v.T if transpose else v


def _mma(
    pr: _Problem,
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


def _mma_acc(
    pr: _Problem,
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


def _schedule_barrier(pr: _Problem, wg: Any, operation: str) -> None:
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


def _layout(pr: _Problem, x: Any, layout: str, reduce: int | None = None) -> Any:
    if pr.interpret:
        return x
    lay = _compat.gpu_layout(layout)
    return _compat.plgpu().layout_cast(x, lay.reduce(reduce) if reduce is not None else lay)


def _load_row_vector(pr: _Problem, ref: Any, axis: int) -> Any:
    """A [n] float32 vector from shared memory in the WGMMA layout reduced over ``axis``."""
    if pr.interpret:
        return ref[...]
    return _compat.gpu_load(ref, layout=_compat.gpu_layout("WGMMA").reduce(axis))


def _iota(pr: _Problem, shape: tuple[int, int], dim: int) -> Any:
    if pr.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    plgpu = _compat.plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_compat.gpu_layout("WGMMA"))


def _smem(pr: _Problem, shape: tuple[int, ...], dtype: Any, tiled: bool = True) -> Any:
    plgpu = _compat.plgpu()
    if not tiled:
        return plgpu.SMEM(shape, dtype)
    swizzle = 128
    transforms = (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)


#: The causal forward launches its query tiles longest first: the grid runs heads fastest, so
#: each wave holds tiles of one length, and in query order the last wave holds the longest ones
#: (a long tail on few SMs); on an H100 longest first is 5-7 % faster at D 64 and D 128. The
#: dQ kernel keeps query order: reversed, it is no faster.
LONGEST_FIRST = True


def _q_tile(pr: _Problem) -> Any:
    """This forward CTA's pair of query blocks: the grid's ``q_tiles`` index, reversed when
    causal (bottom-right aligned, the last query rows see the most keys)."""
    i = lax.axis_index("q_tiles")
    if pr.causal and LONGEST_FIRST:
        return jnp.int32(pr.sq // (2 * pr.bq) - 1) - i
    return i


def _launch(
    pr: _Problem,
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


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def _fwd_barriers(pr: _Problem) -> list[Any]:
    """K landed, V landed, Q landed (per consumer), K slot free, V slot free."""
    plgpu = _compat.plgpu()
    return [
        plgpu.Barrier(num_barriers=pr.stages),
        plgpu.Barrier(num_barriers=pr.stages),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=2, num_barriers=pr.stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=pr.stages),
    ]


def _fwd_step(
    pr: _Problem,
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
    their landed and free barriers; ``mask`` sets hidden scores to -inf; ``rows`` (default
    ``bk``) is how many leading rows of the slots the block fills (a tail step's TAIL_ROWS)."""
    pl, plgpu = _compat.pl, _compat.plgpu()
    k_smem, v_smem, k_landed, v_landed, k_free, v_free = ring
    acc, m, denom = carry
    slot = lax.rem(step, jnp.int32(pr.stages))
    k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
    rows = rows or pr.bk
    if rows != pr.bk:
        part = pl.ds(step * 0, rows)  # a traced start: see _mma_acc
        k_tile, v_tile = k_smem.at[slot, part], v_smem.at[slot, part]
    s = _mma(pr, q_smem, k_tile, (pr.bq, rows), transpose_b=True, after_issue=issued)
    plgpu.barrier_arrive(k_free.at[slot])
    if mask is not None:
        s = mask(s)
    # The softmax scale (base 2) folds into the exponent's argument: one FMA a logit.
    scale = pr.scale * LOG2E
    m_new = jnp.maximum(m, s.max(axis=1) * scale)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    denom = denom * alpha + p.sum(axis=1)
    p16 = p.astype(pr.dtype)
    # Pin the order: the softmax finishes before the barriers below (together with the scale
    # fold above, about 3 % on the D 128 forward).
    acc, p16 = lax.optimization_barrier((acc, p16))
    denom, m_new = lax.optimization_barrier((denom, m_new))
    plgpu.barrier_wait(v_landed.at[slot])
    wait_other()
    nxt = step + 1

    def wait_next_k() -> None:
        @pl.when(nxt < end)
        def _():
            plgpu.barrier_wait(k_landed.at[lax.rem(nxt, pr.stages)])

    # D 128: wait for the next K tile while P·V runs (tokamax's order), +1 % forward; D 64,
    # whose P·V is too short to hide the wait, -3 %: after it (H100, same run).
    if pr.d >= 128:
        acc = _mma_acc(pr, acc, p16, v_tile, after_issue=wait_next_k)
    else:
        acc = _mma_acc(pr, acc, p16, v_tile)
        wait_next_k()
    plgpu.barrier_arrive(v_free.at[slot])
    return acc, m_new, denom


def _fwd_call(
    q: jax.Array, k: jax.Array, v: jax.Array, pr: _Problem
) -> tuple[jax.Array, jax.Array]:
    """out [B, Sq, Hq, D] and the base-2 logsumexp [B, Hq, Sq] (float32)."""
    persistent = pr.d in PERSISTENT_FORWARD_HEAD_DIMS and not pr.causal and not pr.tail
    if persistent and pr.fwd_tiles > _sm_count(pr):
        return _fwd_persistent_call(q, k, v, pr)
    scratch = [
        (
            _smem(pr, (2, pr.bq, pr.d), pr.dtype),  # Q in, O out, per consumer
            _smem(pr, (pr.stages, pr.bk, pr.d), pr.dtype),
            _smem(pr, (pr.stages, pr.bk, pr.d), pr.dtype),
            _smem(pr, (2, pr.bq), jnp.float32, tiled=False),
        ),
        *_fwd_barriers(pr),
    ]
    out_types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq), jnp.float32),
    ]
    out, lse = _launch(
        pr,
        functools.partial(_flash_attention_fwd_kernel, pr=pr),
        out=out_types,
        scratch=scratch,
        grid=(pr.hq, pr.sq // (2 * pr.bq), pr.b),
        grid_names=("heads", "q_tiles", "batch"),
        name="ejkernel_flash_attention_fwd",
    )(q, k, v)
    return out, lse


def _flash_attention_fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    smem,
    k_landed,
    v_landed,
    q_landed,
    k_free,
    v_free,
    *,
    pr: _Problem,
):
    pl, plgpu = _compat.pl, _compat.plgpu()
    qo_smem2, k_smem, v_smem, lse_smem2 = smem
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile_q0 = _q_tile(pr) * (2 * pr.bq)
    cta_steps = pr.kv_steps(tile_q0 + pr.bq)  # the second consumer's rows see the most
    bq, bk, d = pr.bq, pr.bk, pr.d

    # FA3's ping-pong on two hardware named barriers: a consumer signals the other once its
    # Q·Kᵀ is issued, and issues its P·V only after the other's Q·Kᵀ is, so one consumer's
    # softmax runs under the other's matmuls. Strictly alternating, balanced at the ends.
    issued = functools.partial(_schedule_barrier, pr, wg, "arrive")
    wait_other = functools.partial(_schedule_barrier, pr, wg, "sync")

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q0 = tile_q0 + wg * bq
        steps = pr.kv_steps(q0)
        full = pr.kv_full_steps(q0, steps)
        qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], qo_smem, q_landed.at[wg])
        plgpu.barrier_wait(q_landed.at[wg])
        m = _layout(pr, jnp.full((bq,), M_INIT, jnp.float32), "WGMMA", reduce=1)
        denom = _layout(pr, jnp.full((bq,), 0.0, jnp.float32), "WGMMA", reduce=1)
        acc = _layout(pr, jnp.full((bq, d), 0.0, jnp.float32), "WGMMA")

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_landed.at[0])

        pl.when(wg == 1)(wait_other)

        ring = (k_smem, v_smem, k_landed, v_landed, k_free, v_free)

        def causal_mask(j: Any, s: Any) -> Any:
            rows = _iota(pr, (bq, bk), 0) + (q0 + pr.offset)
            cols = _iota(pr, (bq, bk), 1) + j * bk
            return jnp.where(cols <= rows, s, -jnp.inf)

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
            tail_step = functools.partial(step, masked=False, rows=TAIL_ROWS)
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
        lse_smem[...] = jnp.where(empty, EMPTY_ROW_LSE, m + jnp.log2(l_safe))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q0, bq), h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_h = lax.div(h, jnp.int32(pr.group))

        def copy(start, n, slot, rows):
            src = (b, pl.ds(start, n), kv_h)
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[rows], k_landed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[rows], v_landed.at[slot])

        def load(j, slot):
            if not pr.tail:
                copy(j * bk, bk, slot, slot)
                return
            wide = pr.wide_steps
            pl.when(j < wide)(lambda: copy(j * bk, bk, slot, slot))
            tail_rows = (slot, pl.ds(j * 0, TAIL_ROWS))
            tail_start = wide * bk + (j - wide) * TAIL_ROWS
            pl.when(j >= wide)(lambda: copy(tail_start, TAIL_ROWS, slot, tail_rows))

        _produce(pr, cta_steps, load, (k_free, v_free), start=jnp.int32(0))


#: Non-causal forwards at D 64 with more tiles than SMs run persistent (_fwd_persistent_call):
#: on an H100 about 3 % faster than the grid launch at D 64, slower at D 128 (which keeps the
#: grid).
PERSISTENT_FORWARD_HEAD_DIMS = (64,)


def _sm_count(pr: _Problem) -> int:
    """CTAs of a persistent launch: the GPU's SMs (3 in interpret mode, to loop over tiles)."""
    if pr.interpret:
        return 3
    return int(getattr(jax.devices()[0], "core_count", 132) or 132)


def _fwd_persistent_call(
    q: jax.Array, k: jax.Array, v: jax.Array, pr: _Problem
) -> tuple[jax.Array, jax.Array]:
    """The non-causal forward as a persistent kernel: one CTA per SM walks the (head, query
    tile, batch) tiles ``cta, cta + ctas, …``; its producer streams the K/V tiles of all of them
    through one ring, so the next tile's first loads overlap this tile's epilogue, and each
    consumer loads its next Q before writing its output (separate Q and O buffers)."""
    tiles = pr.fwd_tiles
    ctas = min(_sm_count(pr), tiles)
    scratch = [
        (
            _smem(pr, (2, pr.bq, pr.d), pr.dtype),  # Q, per consumer
            _smem(pr, (2, pr.bq, pr.d), pr.dtype),  # O, per consumer
            _smem(pr, (pr.stages, pr.bk, pr.d), pr.dtype),
            _smem(pr, (pr.stages, pr.bk, pr.d), pr.dtype),
            _smem(pr, (2, pr.bq), jnp.float32, tiled=False),
        ),
        *_fwd_barriers(pr),
    ]
    out_types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq), jnp.float32),
    ]
    out, lse = _launch(
        pr,
        functools.partial(_fwd_persistent_kernel, pr=pr, tiles=tiles, ctas=ctas),
        out=out_types,
        scratch=scratch,
        grid=(ctas,),
        grid_names=("cta",),
        name="ejkernel_flash_attention_fwd_persistent",
    )(q, k, v)
    return out, lse


def _fwd_persistent_kernel(
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    smem,
    k_landed,
    v_landed,
    q_landed,
    k_free,
    v_free,
    *,
    pr: _Problem,
    tiles: int,
    ctas: int,
):
    pl, plgpu = _compat.pl, _compat.plgpu()
    q_smem2, o_smem2, k_smem, v_smem, lse_smem2 = smem
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

    issued = functools.partial(_schedule_barrier, pr, wg, "arrive")
    wait_other = functools.partial(_schedule_barrier, pr, wg, "sync")

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
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
            m = _layout(pr, jnp.full((bq,), M_INIT, jnp.float32), "WGMMA", reduce=1)
            denom = _layout(pr, jnp.full((bq,), 0.0, jnp.float32), "WGMMA", reduce=1)
            acc = _layout(pr, jnp.full((bq, d), 0.0, jnp.float32), "WGMMA")
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

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(g, slot):
            b, h, _ = tile_of(lax.div(g, jnp.int32(nk)))
            rows = (b, pl.ds(lax.rem(g, jnp.int32(nk)) * bk, bk), lax.div(h, jnp.int32(pr.group)))
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_landed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_landed.at[slot])

        _produce(pr, mine * nk, load, (k_free, v_free), start=jnp.int32(0))


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


def _bwd_dq_call(q, k, v, do, lse, delta, pr: _Problem) -> jax.Array:
    """dQ [B, Sq, Hq, D]: consumers own query rows and stream K/V."""
    plgpu = _compat.plgpu()
    scratch = [
        (
            _smem(pr, (2, pr.bq, pr.d), pr.dtype),  # Q, then dQ out
            _smem(pr, (2, pr.bq, pr.d), pr.dtype),  # dO
            _smem(pr, (2, pr.bq), jnp.float32, tiled=False),  # lse
            _smem(pr, (2, pr.bq), jnp.float32, tiled=False),  # delta
            _smem(pr, (pr.stages, pr.bk, pr.d), pr.dtype),
            _smem(pr, (pr.stages, pr.bk, pr.d), pr.dtype),
        ),
        plgpu.Barrier(num_barriers=2),  # Q, dO, lse, delta landed (one barrier each)
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=pr.stages),  # K landed
        plgpu.Barrier(num_barriers=pr.stages),  # V landed
        plgpu.Barrier(num_arrivals=2, num_barriers=pr.stages),  # K/V slot free
    ]
    return _launch(
        pr,
        functools.partial(_bwd_dq_kernel, pr=pr),
        out=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch=scratch,
        grid=(pr.hq, pr.sq // (2 * pr.bq), pr.b),
        grid_names=("heads", "q_tiles", "batch"),
        name="ejkernel_flash_attention_bwd_dq",
    )(q, k, v, do, lse, delta)


def _bwd_dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    smem,
    q_landed,
    do_landed,
    lse_landed,
    delta_landed,
    k_landed,
    v_landed,
    kv_free,
    *,
    pr: _Problem,
):
    pl, plgpu = _compat.pl, _compat.plgpu()
    q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem = smem
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile_q0 = lax.axis_index("q_tiles") * (2 * pr.bq)
    cta_steps = pr.kv_steps(tile_q0 + pr.bq)
    bq, bk, d = pr.bq, pr.bk, pr.d

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q0 = tile_q0 + wg * bq
        steps = pr.kv_steps(q0)
        full = pr.kv_full_steps(q0, steps)
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        rows = (b, pl.ds(q0, bq), h)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_landed.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_landed.at[wg])
        plgpu.copy_gmem_to_smem(
            lse_ref.at[b, h, pl.ds(q0, bq)], lse_smem2.at[wg], lse_landed.at[wg]
        )
        plgpu.copy_gmem_to_smem(
            delta_ref.at[b, h, pl.ds(q0, bq)], delta_smem2.at[wg], delta_landed.at[wg]
        )
        for barrier in (q_landed, do_landed, lse_landed, delta_landed):
            plgpu.barrier_wait(barrier.at[wg])
        lse = _load_row_vector(pr, lse_smem2.at[wg], 1)
        delta = _load_row_vector(pr, delta_smem2.at[wg], 1)
        dq = _layout(pr, jnp.full((bq, d), 0.0, jnp.float32), "WGMMA")

        def step(j, dq, masked: bool):
            slot = lax.rem(j, jnp.int32(pr.stages))
            plgpu.barrier_wait(k_landed.at[slot])
            s = _mma(pr, q_smem, k_smem.at[slot], (bq, bk), transpose_b=True)
            s = s * (pr.scale * LOG2E)
            if masked:
                q_pos = _iota(pr, (bq, bk), 0) + (q0 + pr.offset)
                k_pos = _iota(pr, (bq, bk), 1) + j * bk
                s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            plgpu.barrier_wait(v_landed.at[slot])
            dp = _mma(pr, do_smem, v_smem.at[slot], (bq, bk), transpose_b=True)
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            dq = _mma_acc(pr, dq, ds.astype(pr.dtype), k_smem.at[slot])
            plgpu.barrier_arrive(kv_free.at[slot])
            return dq

        dq = lax.fori_loop(0, full, functools.partial(step, masked=False), dq)
        if pr.causal:
            dq = lax.fori_loop(full, steps, functools.partial(step, masked=True), dq)
            _release_slots(pr, steps, cta_steps, (k_landed, v_landed), kv_free)
        q_smem[...] = (dq * pr.scale).astype(pr.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_h = lax.div(h, jnp.int32(pr.group))

        def load(j, slot):
            rows = (b, pl.ds(j * bk, bk), kv_h)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_landed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_landed.at[slot])

        _produce(pr, cta_steps, load, (kv_free,), start=jnp.int32(0))


def _release_slots(pr: _Problem, begin: Any, end: Any, landed: tuple[Any, ...], free: Any) -> None:
    """Steps ``[begin, end)`` this consumer skips: wait for their data (keeping every
    barrier's phase in step with the producer) and hand the slot back."""
    plgpu = _compat.plgpu()

    def release(j, _):
        slot = lax.rem(j, jnp.int32(pr.stages))
        for barrier in landed:
            plgpu.barrier_wait(barrier.at[slot])
        plgpu.barrier_arrive(free.at[slot])

    lax.fori_loop(begin, end, release, None)


def _produce(
    pr: _Problem, end: Any, load: Callable[[Any, Any], None], free: tuple[Any, ...], *, start: Any
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


def _bwd_dkv_call(q, k, v, do, lse, delta, pr: _Problem) -> tuple[jax.Array, jax.Array]:
    """dK, dV per query head [B, Sk, Hq, D] (float32 when summed over a GQA group after)."""
    plgpu = _compat.plgpu()
    out_dtype = pr.dtype if pr.group == 1 else jnp.float32
    scratch = [
        (
            _smem(pr, (2, pr.bk, pr.d), pr.dtype),  # K, then dK out
            _smem(pr, (2, pr.bk, pr.d), pr.dtype),  # V, then dV out
            _smem(pr, (pr.stages, pr.bq, pr.d), pr.dtype),  # Q ring
            _smem(pr, (pr.stages, pr.bq, pr.d), pr.dtype),  # dO ring
            _smem(pr, (pr.stages, pr.bq), jnp.float32, tiled=False),  # lse ring
            _smem(pr, (pr.stages, pr.bq), jnp.float32, tiled=False),  # delta ring
        ),
        plgpu.Barrier(num_barriers=2),  # K landed
        plgpu.Barrier(num_barriers=2),  # V landed
        plgpu.Barrier(num_barriers=pr.stages),  # Q landed
        plgpu.Barrier(num_barriers=pr.stages),  # dO landed
        plgpu.Barrier(num_barriers=pr.stages),  # lse landed
        plgpu.Barrier(num_barriers=pr.stages),  # delta landed
        plgpu.Barrier(num_arrivals=2, num_barriers=pr.stages),  # ring slot free
    ]
    if out_dtype != pr.dtype:
        scratch[0] = (*scratch[0], _smem(pr, (2, pr.bk, pr.d), jnp.float32, tiled=False))
    shape = (pr.b, pr.sk, pr.hq, pr.d)
    return _launch(
        pr,
        functools.partial(_bwd_dkv_kernel, pr=pr, out_dtype=out_dtype),
        out=[jax.ShapeDtypeStruct(shape, out_dtype)] * 2,
        scratch=scratch,
        grid=(pr.hq, pr.sk // (2 * pr.bk), pr.b),
        grid_names=("heads", "kv_tiles", "batch"),
        name="ejkernel_flash_attention_bwd_dkv",
    )(q, k, v, do, lse, delta)


def _bwd_dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    smem,
    k_landed,
    v_landed,
    q_landed,
    do_landed,
    lse_landed,
    delta_landed,
    free,
    *,
    pr: _Problem,
    out_dtype: Any,
):
    pl, plgpu = _compat.pl, _compat.plgpu()
    k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *f32_out = smem
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile_k0 = lax.axis_index("kv_tiles") * (2 * pr.bk)
    cta_start = pr.q_start(tile_k0)  # the first consumer's keys are seen earliest
    bq, bk, d = pr.bq, pr.bk, pr.d
    kv_h = lax.div(h, jnp.int32(pr.group))
    ring = (q_landed, do_landed, lse_landed, delta_landed)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        k0 = tile_k0 + wg * bk
        start = pr.q_start(k0)
        full_from = pr.q_full_start(k0, start)
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        rows = (b, pl.ds(k0, bk), kv_h)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, k_landed.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, v_landed.at[wg])
        plgpu.barrier_wait(k_landed.at[wg])
        plgpu.barrier_wait(v_landed.at[wg])
        zeros = jnp.full((bk, d), 0.0, jnp.float32)
        carry = (_layout(pr, zeros, "WGMMA"), _layout(pr, zeros, "WGMMA"))
        if pr.causal:
            _release_slots(pr, cta_start, start, ring, free)

        def step(i, carry, masked: bool):
            dk, dv = carry
            slot = lax.rem(i - cta_start, jnp.int32(pr.stages))
            plgpu.barrier_wait(q_landed.at[slot])
            s_t = _mma(pr, k_smem, q_smem.at[slot], (bk, bq), transpose_b=True)
            s_t = s_t * (pr.scale * LOG2E)
            if masked:
                k_pos = _iota(pr, (bk, bq), 0) + k0
                q_pos = _iota(pr, (bk, bq), 1) + (i * bq + pr.offset)
                s_t = jnp.where(k_pos <= q_pos, s_t, -jnp.inf)
            plgpu.barrier_wait(lse_landed.at[slot])
            lse = _load_row_vector(pr, lse_smem.at[slot], 0)
            p_t = jnp.exp2(s_t - lax.broadcast_in_dim(lse, s_t.shape, [1]))
            plgpu.barrier_wait(do_landed.at[slot])
            dv = _mma_acc(pr, dv, p_t.astype(pr.dtype), do_smem.at[slot])
            dp_t = _mma(pr, v_smem, do_smem.at[slot], (bk, bq), transpose_b=True)
            plgpu.barrier_wait(delta_landed.at[slot])
            delta = _load_row_vector(pr, delta_smem.at[slot], 0)
            ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
            dk = _mma_acc(pr, dk, ds_t.astype(pr.dtype), q_smem.at[slot])
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

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(i, slot):
            rows = (b, pl.ds(i * bq, bq), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_landed.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_landed.at[slot])
            vec = (b, h, pl.ds(i * bq, bq))
            plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[slot], lse_landed.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[slot], delta_landed.at[slot])

        _produce(pr, jnp.int32(pr.nq), load, (free,), start=cta_start)
