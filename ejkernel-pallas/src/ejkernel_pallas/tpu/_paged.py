"""What the Mosaic TPU serving kernels (``page_attention``, ``ragged_page_attention``) share:
device limits, the launch record, the page DMAs and the online softmax over a sequence's pages.

**Paged layout** (OPS.md): ``key_cache``/``value_cache`` ``[num_pages, page_size, Hkv, D]``; the
kernels never copy or transpose the caches. The caches stay in HBM (``pl.ANY``); the block tables,
lengths and offsets are scalar-prefetched into SMEM (``PrefetchScalarGridSpec``), and a kernel
copies whole pages ``[page_size, Hkv, D]`` (every KV head at once, so a page crosses HBM once)
into a double-buffered VMEM block of ``pages_per_block`` pages, starting the DMA of the next
block before computing on the current one (a sequence's first block is not prefetched across
grid steps, which keeps every step independent: "parallel" grids split over megacores). Only
live table slots are read: slot ``j`` of a
sequence with ``live = ceil(kv_len / page_size)`` pages fetches page ``table[min(j, live - 1)]``
(clipped to ``[0, num_pages)``), so garbage such as ``-1`` or ``10**6`` past the live pages is
never dereferenced.

**Heads.** KV head ``h`` of a block is the ref read ``buf[slot, :, :, h, :]`` (a sublane-strided
load) reshaped to ``[pages_per_block · page_size, D]``; on a TPU that reshape is free only when
``page_size`` is a multiple of the sublane tiling (8 rows of 32-bit, 16 of 16-bit data), which
``supports()`` requires there. The ``G = Hq // Hkv`` query heads of a KV head form the rows of
one logits tile ``[R, N]`` (``R = tokens · G``), so K and V are never repeated (GQA).

**Masking** is :mod:`ejkernel.attention_semantics`: positions bottom-right aligned per sequence
(its queries are its last tokens), causal, ``sliding_window`` ``(left, right)``, keys past
``kv_len`` invalid; scores of hidden keys are selected to ``MASK_VALUE``, their probabilities to
exact zeros, and on every block where some key is hidden from some row, the V tile is cleaned
by ``finite_or_zero`` (in float32: Mosaic tests finiteness of 32-bit floats only) before ``P·V``
(K needs no cleaning: its scores are selected away), so a
NaN or Inf in a stale slot, outside the window or causally after a query reaches no row. Rows of
a query block that belong to another sequence keep their state by a select. Sinks
(``softmax_aux``) join the maximum and the denominator when the rows are finished.

**Limits.** VMEM per TensorCore by device kind (:data:`VMEM_BY_KIND`, as jax's
``pallas.mosaic.tpu_info``: v5e and v6e 128 MiB, v5p 64 MiB); a launch may claim three quarters
of it (``vmem_limit_bytes``), 12 MiB where the kind is unknown (the CPU interpreter). Scalar
prefetch lives in SMEM (1 MiB on v5e/v5p/v6e). :func:`vmem_bytes` estimates one grid step with
the TPU's tiled layouts (second-minor dims padded to their sublane tiling, minor dims to 128
lanes); config spaces keep what fits and ``supports()`` declines a call nothing fits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel import env
from ejkernel.attention_semantics import (
    MASK_VALUE,
    hide,
    mask_scores,
    soft_cap,
    visible,
)

# Not `_compat`: the `__repr__` attrs generates reads attrs' own `_compat` from this module.
from ejkernel_pallas import _compat as compat
from ejkernel_pallas.tpu._numerics import finite_or_zero, precision, when

LANES = 128
SUBLANES = 8
MiB = 2**20
#: VMEM bytes per TensorCore by ``jax.Device.device_kind``.
VMEM_BY_KIND: dict[str, int] = {
    "TPU v5 lite": 128 * MiB,
    "TPU v5e": 128 * MiB,
    "TPU v5": 64 * MiB,
    "TPU v5p": 64 * MiB,
    "TPU v6 lite": 128 * MiB,
    "TPU v6e": 128 * MiB,
}
#: VMEM assumed where the kind is unknown: the smallest scoped default (v5e's 16 MiB).
DEFAULT_VMEM = 16 * MiB
#: SMEM bytes per TensorCore on v5e, v5p and v6e; scalar prefetch may take three quarters.
SMEM_BYTES = 1 * MiB
#: Keys per kv block the heuristics aim at (whole pages), and the largest the spaces offer.
KV_BLOCK_TARGET = 512
KV_BLOCK_MAX = 2048


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def device_kind() -> str:
    """The default device's ``device_kind`` on a TPU, else the backend's name."""
    if jax.default_backend() != "tpu":
        return jax.default_backend()
    return str(jax.devices()[0].device_kind)


def vmem_budget(kind: str | None = None) -> int:
    """VMEM one launch may claim on ``kind`` (the default device when ``None``)."""
    kind = device_kind() if kind is None else kind
    return VMEM_BY_KIND.get(kind, DEFAULT_VMEM) * 3 // 4


def smem_budget() -> int:
    return SMEM_BYTES * 3 // 4


def sublane_tiling(dtype: Any) -> int:
    """Rows of one VMEM tile of ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit data."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def tiled_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of a VMEM buffer of ``shape``: the second-minor dim padded to its tiling (the
    smallest power of two from the dtype's packing that covers it, at most
    :func:`sublane_tiling`), the minor dim to 128 lanes (as Mosaic's memref layout inference)."""
    itemsize = jnp.dtype(dtype).itemsize
    *lead, rows, cols = shape
    tile = max(1, 4 // itemsize)
    while tile < min(rows, sublane_tiling(dtype)):
        tile *= 2
    return math.prod(lead) * round_up(rows, tile) * round_up(cols, LANES) * itemsize


def page_layout_reason(page_size: int, dtype: Any, backend: str) -> str | None:
    """Why a TPU cannot read one KV head of a page block as a ``[pages · page_size, D]`` tile,
    or ``None``. The interpreter (any other backend) has no tiling."""
    tile = sublane_tiling(dtype)
    if backend == "tpu" and page_size % tile:
        return (
            f"the Pallas TPU serving kernels need page_size to be a multiple of {tile} for "
            f"{jnp.dtype(dtype).name} caches (a page block's head is read as one "
            f"[pages * page_size, D] tile); got page_size={page_size}"
        )
    return None


@attrs.frozen(kw_only=True)
class Launch:
    """Everything static about one serving launch (hashable: it parametrises the kernel).

    Attributes:
        num_pages, page_size, hkv, d: the cache's sizes.
        max_pages: the block table's width.
        group: query heads per KV head, ``G``.
        rows: logits rows per KV head of one grid step (``G`` for decode, ``bq · G``).
        pages_per_block: pages per kv block (``N = pages_per_block · page_size`` keys).
        scale: ``softmax_scale``.
        cap: ``logits_soft_cap`` or ``None``.
        window: ``(left, right)`` or ``None``.
        sinks: whether ``softmax_aux`` joins the softmax.
        dtype: the cache (and query) dtype.
        interpret: run in Pallas's TPU interpret mode (:func:`interpreting`).
    """

    num_pages: int
    page_size: int
    hkv: int
    d: int
    max_pages: int
    group: int
    rows: int
    pages_per_block: int
    scale: float
    cap: float | None
    window: tuple[int, int] | None
    sinks: bool
    dtype: Any
    interpret: bool = attrs.field(factory=lambda: interpreting())

    @property
    def block_keys(self) -> int:
        """Keys per kv block, ``N``."""
        return self.pages_per_block * self.page_size

    @property
    def capacity(self) -> int:
        """Most keys a sequence can hold, ``max_pages · page_size``."""
        return self.max_pages * self.page_size


def interpreting() -> bool:
    """Whether launches run in TPU interpret mode: off a TPU (reachable only with
    ``EJKERNEL_INTERPRET=1``, see the plugin's availability), or on one when it is set."""
    return jax.default_backend() != "tpu" or env.interpret()


def vmem_bytes(lp: Launch) -> int:
    """Rough VMEM of one grid step: the double-buffered K/V page blocks, the pipelined query,
    output (and sink) blocks, the f32 softmax state and the f32 ``[R, N]`` temporaries."""
    pages = tiled_bytes((lp.pages_per_block, lp.page_size, lp.hkv, lp.d), lp.dtype)
    rows = tiled_bytes((lp.hkv, lp.rows, lp.d), lp.dtype)
    state = tiled_bytes((lp.hkv, lp.rows, LANES), jnp.float32)
    acc = tiled_bytes((lp.hkv, lp.rows, lp.d), jnp.float32)
    temps = 4 * tiled_bytes((lp.rows, lp.block_keys), jnp.float32)
    temps += 2 * tiled_bytes((lp.block_keys, lp.d), jnp.float32)
    return 2 * 2 * pages + 2 * 2 * rows + 2 * state + acc + 2 * lp.sinks * state + temps


def pages_per_block(kv_blocksize: int | None, page_size: int, max_pages: int) -> int:
    """Whole pages per kv block: ``kv_blocksize`` keys rounded down to pages (at least one;
    :data:`KV_BLOCK_TARGET` when ``None``), at most the table's width."""
    keys = KV_BLOCK_TARGET if kv_blocksize is None else int(kv_blocksize)
    return max(1, min(keys // page_size, max_pages))


def kv_block_choices(page_size: int, max_pages: int) -> list[int]:
    """Pages per block the config spaces offer: blocks of 128 to :data:`KV_BLOCK_MAX` keys."""
    keys = (128, 256, 512, 1024, KV_BLOCK_MAX)
    return sorted({pages_per_block(k, page_size, max_pages) for k in keys})


def fits(lp: Launch) -> bool:
    """Whether a grid step of ``lp`` fits the VMEM budget."""
    return vmem_bytes(lp) <= vmem_budget()


def budget_reason(op: str, *, vmem: int, blocks: str, smem: int, prefetched: str) -> str | None:
    """Why ``op``'s kernel cannot run: a grid step of ``blocks`` needs ``vmem`` bytes of VMEM,
    over :func:`vmem_budget`, or the ``prefetched`` scalars take ``smem`` bytes of SMEM, over
    :func:`smem_budget`; ``None`` when both fit."""
    if vmem > vmem_budget():
        return (
            f"the Pallas TPU {op} needs {vmem} bytes of VMEM for {blocks}; the budget is "
            f"{vmem_budget()}"
        )
    if smem > smem_budget():
        return (
            f"the Pallas TPU {op} prefetches {prefetched} into SMEM: {smem} bytes exceed the "
            f"budget of {smem_budget()}"
        )
    return None


#: The cache dtypes the serving kernels take.
CACHE_DTYPES = ("float32", "bfloat16", "float16")


def cache_reason(op: str, kw: Any, lp: Launch) -> str | None:
    """Why ``op``'s kernel cannot read the call's caches (float8 scales, a dtype outside
    :data:`CACHE_DTYPES`, a page layout the TPU cannot tile), or ``None``."""
    for name in ("k_scale", "v_scale"):
        if kw.get(name) is not None:
            return (
                f"the Pallas TPU {op} does not implement {name} (fp8 caches); "
                "the XLA plugin serves it"
            )
    dtype = jnp.dtype(kw["key_cache"].dtype).name
    if dtype not in CACHE_DTYPES:
        return f"the Pallas TPU {op} takes {'/'.join(CACHE_DTYPES)} caches; got {dtype}"
    return page_layout_reason(lp.page_size, lp.dtype, jax.default_backend())


def smem_bytes(*lengths: int) -> int:
    """SMEM of int32 scalar-prefetch arrays of these lengths (each padded to 128 words)."""
    return sum(round_up(max(n, 1), LANES) * 4 for n in lengths)


def launch_of(kw: Any, query: str, *, q_block: int, kv_blocksize: int | None) -> Launch:
    """The launch of validated arguments (arrays or their abstract shapes): ``q_block`` query
    tokens of ``kw[query]`` per grid step (``rows = q_block · G``), kv blocks of
    ``kv_blocksize`` keys (:func:`pages_per_block`)."""
    num_pages, page_size, hkv, d = kw["key_cache"].shape
    max_pages = kw["block_tables"].shape[1]
    group = kw[query].shape[1] // hkv
    scale, cap, window = (kw.get(n) for n in ("softmax_scale", "logits_soft_cap", "sliding_window"))
    return Launch(
        num_pages=num_pages,
        page_size=page_size,
        hkv=hkv,
        d=d,
        max_pages=max_pages,
        group=group,
        rows=q_block * group,
        pages_per_block=pages_per_block(kv_blocksize, page_size, max_pages),
        scale=float(d**-0.5 if scale is None else scale),
        cap=None if cap is None else float(cap),
        window=None if window is None else (int(window[0]), int(window[1])),
        sinks=kw.get("softmax_aux") is not None,
        dtype=jnp.dtype(kw["key_cache"].dtype),
    )


def sink_rows(softmax_aux: jax.Array | None, hkv: int, tokens: int) -> jax.Array | None:
    """Sink logits per logits row, ``[Hkv, tokens · G, 128]`` float32: row ``t · G + g`` of KV
    head ``h`` holds query head ``h · G + g``'s sinks in its first lanes, ``MASK_VALUE`` after."""
    if softmax_aux is None:
        return None
    hq = softmax_aux.shape[0]
    aux = softmax_aux.astype(jnp.float32).reshape(hq, -1)
    n_pad = round_up(aux.shape[1], LANES)
    aux = jnp.pad(aux, ((0, 0), (0, n_pad - aux.shape[1])), constant_values=MASK_VALUE)
    aux = aux[:, :LANES] if n_pad == LANES else _fold_lanes(aux)
    aux = aux.reshape(hkv, 1, hq // hkv, LANES)
    return jnp.broadcast_to(aux, (hkv, tokens, hq // hkv, LANES)).reshape(hkv, -1, LANES)


def _fold_lanes(aux: jax.Array) -> jax.Array:
    """More than 128 sinks per head: their logsumexp in lane 0 (the softmax sees only the sum
    of their exponentials)."""
    lse = jax.nn.logsumexp(aux, axis=1, keepdims=True)
    return jnp.pad(lse, ((0, 0), (0, LANES - 1)), constant_values=MASK_VALUE)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------


def serve(
    attend: Callable[..., None],
    lp: Launch,
    q: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    *scalars: jax.Array,
    name: str,
    grid: tuple[int, ...],
    rows: Any,
    aux: jax.Array | None = None,
) -> jax.Array:
    """Run a serving kernel: ``pl.pallas_call`` over a "parallel" ``grid`` with the VMEM limit.

    ``kv_lens`` and the flattened ``block_tables`` (int32), then ``scalars``, are
    scalar-prefetched; ``q`` and the output (shaped like ``q``) are pipelined by the BlockSpec
    ``rows``; the caches stay in HBM; ``aux`` (sink rows, :func:`sink_rows`) is one whole block.
    The K/V page buffers, their DMA semaphores and the softmax state are scratch. A grid step
    starts the state, runs ``attend(refs, lp, *scalar_refs)`` and writes each KV head's
    normalised rows (:func:`finish`).
    """
    pltpu = compat.pltpu()
    any_space = compat.pl.BlockSpec(memory_space=compat.pl.ANY)
    in_specs = [rows, any_space, any_space]
    extra = []
    if aux is not None:
        in_specs.append(compat.pl.BlockSpec(aux.shape, lambda *_: (0, 0, 0)))
        extra.append(aux)
    pages = (2, lp.pages_per_block, lp.page_size, lp.hkv, lp.d)
    scratch = [
        compat.vmem(pages, lp.dtype),  # K blocks, two slots
        compat.vmem(pages, lp.dtype),  # V blocks, two slots
        pltpu.SemaphoreType.DMA((2, 2)),  # (slot, K or V)
        compat.vmem((lp.hkv, lp.rows, LANES), jnp.float32),  # running max
        compat.vmem((lp.hkv, lp.rows, LANES), jnp.float32),  # running denominator
        compat.vmem((lp.hkv, lp.rows, lp.d), jnp.float32),  # output accumulator
    ]
    kernel = functools.partial(
        _serving_kernel, attend=attend, lp=lp, scalars=2 + len(scalars), sinks=aux is not None
    )
    call = compat.pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 + len(scalars),
            grid=grid,
            in_specs=in_specs,
            out_specs=rows,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=("parallel",) * len(grid),
            vmem_limit_bytes=vmem_budget(),
        ),
        interpret=compat.tpu_interpret_params() if lp.interpret else False,
        name=name,
    )
    call = jax.custom_batching.sequential_vmap(call) if lp.interpret else call
    return call(
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        *scalars,
        q,
        key_cache,
        value_cache,
        *extra,
    )


def _serving_kernel(
    *refs: Any, attend: Callable[..., None], lp: Launch, scalars: int, sinks: bool
) -> None:
    """The body of :func:`serve`: ``refs`` are the ``scalars`` prefetched refs (``kv_lens``
    and the tables first), the query block, the caches, the sink rows when ``sinks``, the
    output block and the scratch."""
    kv_lens_ref, tables_ref, *scalar_refs = refs[:scalars]
    q_ref, k_hbm, v_hbm = refs[scalars : scalars + 3]
    rest = refs[scalars + 3 :]
    aux_ref = rest[0] if sinks else None
    o_ref, k_buf, v_buf, sems, m_sc, l_sc, acc_sc = rest[sinks:]
    state = Refs(
        kv_lens_ref, tables_ref, q_ref, k_hbm, v_hbm, k_buf, v_buf, sems, m_sc, l_sc, acc_sc
    )
    init_state(state)
    attend(state, lp, *scalar_refs)
    for h in range(lp.hkv):
        o_ref[h] = finish(state, lp, aux_ref, h).astype(o_ref.dtype)


# --------------------------------------------------------------------------------------------
# Kernel pieces
# --------------------------------------------------------------------------------------------


class Refs(NamedTuple):
    """The refs every serving kernel passes to :func:`attend_sequence` and :func:`finish`."""

    kv_lens: Any  # SMEM [S]
    tables: Any  # SMEM [S · max_pages]
    q: Any  # VMEM [Hkv, R, D]: ``q[h]`` holds the query rows of KV head ``h``
    k_hbm: Any  # HBM [num_pages, page_size, Hkv, D]
    v_hbm: Any
    k_buf: Any  # VMEM [2, pages_per_block, page_size, Hkv, D]
    v_buf: Any
    sems: Any  # DMA [2, 2]
    m: Any  # VMEM [Hkv, R, 128]
    denom: Any  # VMEM [Hkv, R, 128]
    acc: Any  # VMEM [Hkv, R, D]


def init_state(refs: Refs) -> None:
    refs.m[...] = jnp.full(refs.m.shape, MASK_VALUE, jnp.float32)
    refs.denom[...] = jnp.zeros(refs.denom.shape, jnp.float32)
    refs.acc[...] = jnp.zeros(refs.acc.shape, jnp.float32)


def seq_kv_len(refs: Refs, seq: Any, lp: Launch) -> Any:
    """``kv_lens[seq]`` clamped to ``[0, capacity]``."""
    return jnp.clip(refs.kv_lens[seq], 0, lp.capacity)


def kv_block_span(p_lo: Any, p_hi: Any, kv_len: Any, lp: Launch) -> tuple[Any, Any]:
    """Kv blocks ``[lo, hi)`` holding a key visible to some query at positions ``[p_lo,
    p_hi]`` (causal, the window, ``kv_len``); ``hi <= lo`` when none is.

    In-kernel integer division is ``lax.div``/``lax.rem`` on non-negative operands (truncation
    is floor there): ``//`` adds sign corrections whose TPU lowering asks for the chip."""
    n = lp.block_keys
    right = 0 if lp.window is None else min(lp.window[1], 0)
    first = 0 if lp.window is None else jnp.maximum(p_lo - lp.window[0], 0)
    end = jnp.minimum(kv_len, p_hi + right + 1)
    return lax.div(first, n), lax.div(jnp.maximum(end + n - 1, 0), n)


def _copies(refs: Refs, lp: Launch, seq: Any, kv_len: Any, block: Any, slot: Any) -> list[Any]:
    """The DMAs of kv block ``block`` of ``seq`` (K and V pages) into buffer ``slot``."""
    pltpu = compat.pltpu()
    live = lax.div(kv_len + lp.page_size - 1, lp.page_size)
    copies = []
    for i in range(lp.pages_per_block):
        slot_in_table = jnp.minimum(block * lp.pages_per_block + i, live - 1)
        page = jnp.clip(refs.tables[seq * lp.max_pages + slot_in_table], 0, lp.num_pages - 1)
        for which, (hbm, buf) in enumerate(((refs.k_hbm, refs.k_buf), (refs.v_hbm, refs.v_buf))):
            copies.append(
                pltpu.make_async_copy(hbm.at[page], buf.at[slot, i], refs.sems.at[slot, which])
            )
    return copies


def _head_tile(buf: Any, slot: Any, h: int, lp: Launch) -> Any:
    """KV head ``h`` of the block in ``slot``: ``[pages_per_block · page_size, D]``."""
    return buf[slot, :, :, h, :].reshape(lp.block_keys, lp.d)


def attend_sequence(
    refs: Refs,
    lp: Launch,
    *,
    seq: Any,
    kv_len: Any,
    q_pos: Any,
    rows_in_seq: Any,
    p_lo: Any,
    p_hi: Any,
) -> None:
    """Online softmax (FlashAttention-2, Alg. 1) of the state's rows over the kv blocks of
    ``seq`` that rows at positions ``[p_lo, p_hi]`` can see, fetched page by page with the next
    block's DMA in flight while the current one computes.

    Args:
        q_pos: ``[R, 1]`` int32 key positions of the rows.
        rows_in_seq: ``[R, 1]`` bool, the rows of ``seq`` (others keep their state), or
            ``None`` when every row is.
    """
    lo, hi = kv_block_span(p_lo, p_hi, kv_len, lp)
    n = lp.block_keys
    right = 0 if lp.window is None else min(lp.window[1], 0)

    def body(block: Any, carry: Any) -> Any:
        slot = lax.rem(block - lo, 2)

        @when(block + 1 < hi)
        def _prefetch() -> None:
            for copy in _copies(refs, lp, seq, kv_len, block + 1, 1 - slot):
                copy.start()

        for copy in _copies(refs, lp, seq, kv_len, block, slot):
            copy.wait()
        k_lo = block * n
        full = k_lo + n <= jnp.minimum(kv_len, p_lo + right + 1)  # every row sees every key
        if lp.window is not None:
            full = jnp.logical_and(full, k_lo >= p_hi - lp.window[0])

        @when(jnp.logical_not(full))
        def _clean() -> None:  # a hidden value must not reach a row as 0 · NaN
            refs.v_buf[slot] = finite_or_zero(refs.v_buf[slot])

        k_pos = k_lo + lax.broadcasted_iota(jnp.int32, (1, n), 1)
        vis = visible(q_pos, k_pos, causal=True, window=lp.window, kv_valid=k_pos < kv_len)
        if rows_in_seq is not None:
            vis = jnp.logical_and(vis, rows_in_seq)
        for h in range(lp.hkv):
            _update_head(refs, lp, h, refs.q[h], slot, vis, rows_in_seq)
        return carry

    @when(hi > lo)
    def _run() -> None:
        for copy in _copies(refs, lp, seq, kv_len, lo, 0):
            copy.start()
        lax.fori_loop(lo, hi, body, 0)


def _update_head(
    refs: Refs, lp: Launch, h: int, q: Any, slot: Any, vis: Any, rows_in_seq: Any
) -> None:
    """One kv block's online-softmax step for the rows of KV head ``h``."""
    k = _head_tile(refs.k_buf, slot, h, lp)
    v = _head_tile(refs.v_buf, slot, h, lp)
    s = lax.dot_general(
        q,
        k,
        (((1,), (1,)), ((), ())),
        precision=precision(k.dtype),
        preferred_element_type=jnp.float32,
    )
    s = mask_scores(soft_cap(s * lp.scale, lp.cap), vis)
    m_prev, l_prev, acc_prev = refs.m[h], refs.denom[h], refs.acc[h]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, LANES]
    alpha = jnp.exp(m_prev - m_next)
    p = hide(jnp.exp(s - m_next[:, :1]), vis)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision(v.dtype),
        preferred_element_type=jnp.float32,
    )
    acc_next = acc_prev * alpha[:, :1] + pv
    if rows_in_seq is not None:  # rows of other sequences keep their state exactly
        m_next = jnp.where(rows_in_seq, m_next, m_prev)
        l_next = jnp.where(rows_in_seq, l_next, l_prev)
        acc_next = jnp.where(rows_in_seq, acc_next, acc_prev)
    refs.m[h], refs.denom[h], refs.acc[h] = m_next, l_next, acc_next


def finish(refs: Refs, lp: Launch, aux_ref: Any, h: int) -> Any:
    """Normalised output rows ``[R, D]`` (float32) of KV head ``h``; sinks join the maximum
    and the denominator; rows that saw no key are zeros."""
    m, seen, acc = refs.m[h], refs.denom[h], refs.acc[h]
    denom = seen
    if aux_ref is not None:
        aux = aux_ref[h]  # [R, LANES]
        m_all = jnp.maximum(m, jnp.max(aux, axis=1, keepdims=True))
        rescale = jnp.exp(m - m_all)
        denom = seen * rescale + jnp.sum(jnp.exp(aux - m_all[:, :1]), axis=1, keepdims=True)
        acc = acc * rescale[:, :1]
    empty = seen == 0.0
    safe = jnp.where(empty, 1.0, denom)
    return jnp.where(empty[:, :1], 0.0, acc / safe[:, :1])
