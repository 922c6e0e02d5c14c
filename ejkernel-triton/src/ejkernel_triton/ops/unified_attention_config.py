"""The Triton serving attention (``unified_attention`` and the ops mapped onto it): its config,
the sizes a heuristic reads, the heuristic, the config space and ``supports``.

One config class serves every serving op (each op's module derives its own
``<Op>Config`` from :class:`UnifiedAttentionConfig`, so caches keep them apart). The heuristic
reads only static shapes: the packed tokens ``T``, the table rows (an upper bound on the live
sequences), heads, head dim, page size and capacity (``max_pages · page_size``, the longest
context a sequence can hold).

- Rows per program (``q_blocksize``): query tokens × the padded GQA group of one KV head;
  16 rows (vLLM's decode tile) where the batch is decode-like (``T <= 2 · rows``), else 128
  (64 at D > 128) so a prefill chunk's K/V is read once per 128 rows.
- Keys per step (``kv_blocksize``): 64 (32 at D > 128), at most the capacity.
- Splits (``num_splits``): decode-like batches whose programs do not fill
  ``_PROGRAMS_PER_SM`` programs per SM split their keys (at most :data:`MAX_SPLITS`, each
  split at least :data:`MIN_SPLIT_KEYS` keys); prefill-heavy batches (many programs
  already) do not.
- Chunks (``chunk_kernel``): on Hopper, a batch that is not decode-like runs its sequences of
  :data:`PINGPONG_MIN_QUERIES` queries or more on the Gluon ping-pong kernel (128 keys a
  step, 2 stages) where the call is one it takes (:func:`pingpong_refusal`), its shorter
  chunks and its decodes in launches of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel.ops import FwdParams, prune_by_shared_memory
from ejkernel_triton import _launch, _smem
from ejkernel_triton.ops import flash_attention_config
from ejkernel_triton.ops.flash_attention_config import (
    _sm_count,
    fwd_smem,
    pow2,
)

__all__ = [
    "CHUNK_KERNELS",
    "MAX_SPLITS",
    "MIN_SPLIT_KEYS",
    "PINGPONG_MIN_QUERIES",
    "PINGPONG_TILE",
    "SHORT_CHUNKS",
    "Problem",
    "UnifiedAttentionConfig",
    "fit_stages",
    "pingpong_refusal",
    "resolve",
    "selection",
    "serving_supports",
    "smem_need",
    "tuning",
]

#: Most key-range splits of one program's keys.
MAX_SPLITS = 64
#: Fewest keys a split walks.
MIN_SPLIT_KEYS = 256
#: Programs per SM the split count aims at (decode is bound by memory: several programs per
#: SM keep enough loads in flight).
_PROGRAMS_PER_SM = 4
_MAX_HEAD_DIM = 256
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
#: What serves a batch's query chunks: the unified kernel, or the Gluon ping-pong kernel
#: (:mod:`ejkernel_triton.kernels.paged_attention_hopper`; Hopper only).
CHUNK_KERNELS: tuple[str, ...] = ("unified", "pingpong")
#: The ping-pong kernel's tile when the config leaves it open: 128 query rows (two consumer
#: warp groups of 64), 128 keys a step, 2 stages of K and V.
PINGPONG_TILE = FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2)
#: Fewest queries of a sequence the ping-pong kernel serves: its programs are 128 query rows
#: of one head, which a shorter chunk (speculative decoding's few tokens) would mostly leave
#: idle; from about 64 on, half a tile at its rate beats the unified kernel's full tiles.
PINGPONG_MIN_QUERIES = 64


@attrs.frozen(kw_only=True)
class UnifiedAttentionConfig:
    """Tunables of the Triton serving attention; ``None``/0 fields take the heuristic's.

    Attributes:
        fwd_params: ``q_blocksize`` rows per program (query tokens × the KV head's query
            heads, padded to a power of two; at least 16 and the padded group), ``kv_blocksize``
            keys per step (a power of two, at least 16), ``num_warps``, ``num_stages``.
        num_splits: key-range splits per program (split-K, merged after the kernel); 1 turns
            splitting off, 0 takes the heuristic's count.
        decode_launch: in a batch that is not decode-like, the sequences of one query (the
            decodes) in a launch of their own at a decode batch's heuristic tiles and splits,
            the others at these (else every sequence gets these rows, most of them unused by
            a decode).
        chunk_kernel: ``"unified"``, or ``"pingpong"``: the sequences of
            :data:`PINGPONG_MIN_QUERIES` queries or more on the Gluon ping-pong kernel
            (Hopper; :func:`pingpong_refusal` says which calls), at ``fwd_params``'
            ``kv_blocksize`` (64 or 128) and ``num_stages`` (2 or 3; 128 query rows and 4
            warps a consumer, fixed), shorter chunks on the unified kernel at
            :data:`SHORT_CHUNKS`' tile, the decodes in a launch of their own as with
            ``decode_launch``.
        fp8_v_words: float8 caches (head dims a multiple of 16): the unified kernel loads V
            tiles as 32-bit words and widens them to float16 in registers, so P·V reads them
            by matrix fragments instead of one byte at a time; ignored for other caches.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    num_splits: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    decode_launch: bool = False
    chunk_kernel: str = attrs.field(
        default="unified", validator=attrs.validators.in_(CHUNK_KERNELS)
    )
    fp8_v_words: bool = False


#: The unified kernel's tile for the chunks too short for the ping-pong kernel (2 to 63
#: queries) in a ``chunk_kernel="pingpong"`` call: 64 rows (16 tokens of a 4-head group).
SHORT_CHUNKS = UnifiedAttentionConfig(
    fwd_params=FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3), num_splits=1
)


@attrs.frozen(kw_only=True)
class Problem:
    """The static sizes of one serving call.

    Attributes:
        tokens: packed query tokens ``T``.
        rows: sequences the table holds (``kv_lens.shape[0]``), live or not.
        hq, hkv, head_dim: heads and D.
        page_size, max_pages, num_pages: the cache and table sizes.
        itemsize: bytes of a cached element.
    """

    tokens: int
    rows: int
    hq: int
    hkv: int
    head_dim: int
    page_size: int
    max_pages: int
    num_pages: int
    itemsize: int

    @property
    def group_pad(self) -> int:
        """Query heads of one KV head, padded to a power of two."""
        return 1 << (self.hq // self.hkv - 1).bit_length()

    @property
    def capacity(self) -> int:
        return self.page_size * self.max_pages

    @property
    def decode_like(self) -> bool:
        """At most two queries per sequence on average."""
        return self.tokens <= 2 * max(self.rows, 1)

    @classmethod
    def of(cls, queries: Any, key_cache: Any, rows: int, max_pages: int) -> Problem:
        t, hq, d = (int(n) for n in queries.shape)
        num_pages, page_size, hkv, _ = (int(n) for n in key_cache.shape)
        return cls(
            tokens=t,
            rows=int(rows),
            hq=hq,
            hkv=hkv,
            head_dim=d,
            page_size=page_size,
            max_pages=int(max_pages),
            num_pages=num_pages,
            itemsize=jnp.dtype(key_cache.dtype).itemsize,
        )


def block_rows(problem: Problem, rows: int | None) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)``: query tokens and rows per program for ``rows`` asked (``None``:
    the heuristic's), rows a power of two of at least 16 and the padded group."""
    if not rows:
        wide = 64 if problem.head_dim > 128 else 128
        rows = 16 if problem.decode_like else wide
    rows = max(pow2(rows), problem.group_pad)
    return rows // problem.group_pad, rows


def programs(problem: Problem, block_q: int) -> int:
    """The grid's query blocks: ``T // BLOCK_Q + rows`` bounds ``Σ ceil(q_len / BLOCK_Q)``."""
    return problem.tokens // block_q + problem.rows


def default_splits(problem: Problem, block_q: int) -> int:
    """Splits that bring a decode-like batch to ``_PROGRAMS_PER_SM`` programs per SM; 1 for a
    prefill-heavy one or where one split would walk fewer than :data:`MIN_SPLIT_KEYS` keys."""
    busy = min(programs(problem, block_q), max(problem.tokens, 1)) * problem.hkv
    target = _PROGRAMS_PER_SM * (3 if _launch.interpreting() else _sm_count())
    if not problem.decode_like or busy >= target:
        return 1
    by_keys = max(1, problem.capacity // MIN_SPLIT_KEYS)
    return max(1, min(MAX_SPLITS, -(-target // busy), by_keys))


def resolve(problem: Problem, cfg: UnifiedAttentionConfig | None) -> dict[str, int]:
    """The launch's ``block_q``, ``block_m``, ``block_n``, ``num_warps``, ``num_stages`` and
    ``num_splits`` from ``cfg`` (``None`` fields and ``cfg=None``: the heuristic's)."""
    p = cfg.fwd_params if cfg is not None else FwdParams()
    block_q, block_m = block_rows(problem, p.q_blocksize)
    block_n = p.kv_blocksize or (32 if problem.head_dim > 128 else 64)
    block_n = max(16, min(pow2(block_n), pow2(problem.capacity)))
    splits = cfg.num_splits if cfg is not None and cfg.num_splits else 0
    return {
        "block_q": block_q,
        "block_m": block_m,
        "block_n": block_n,
        "num_warps": p.num_warps or (8 if block_m >= 128 else 4),
        "num_stages": p.num_stages or (2 if problem.head_dim > 128 else 3),
        "num_splits": min(splits or default_splits(problem, block_q), MAX_SPLITS),
    }


def kernel_smem(problem: Problem, block_m: int, block_n: int, stages: int) -> int:
    """Shared memory of the kernel, an upper bound: the Q tile once and ``stages`` K and V
    tiles (the flash forward's count,
    :func:`~ejkernel_triton.ops.flash_attention_config.fwd_smem`; Triton allocates less for
    this kernel, e.g. 39 KiB of the 102 KiB counted for 16 rows, 64 keys, D 128, 3 stages)."""
    d = pow2(problem.head_dim)
    return fwd_smem(block_m, block_n, stages, d, d, problem.itemsize)


def fit_stages(problem: Problem, block_m: int, block_n: int, stages: int) -> int:
    """``stages``, fewer while the kernel would need more shared memory than the device has."""
    limit = _smem.launch_limit()
    while stages > 1 and kernel_smem(problem, block_m, block_n, stages) > limit:
        stages -= 1
    return stages


def smem_need(problem: Problem, cfg: UnifiedAttentionConfig) -> int:
    """Bytes of shared memory ``cfg``'s kernel asks for on ``problem`` (the chunks' kernel's,
    with ``chunk_kernel="pingpong"``: Q's 128 rows once, K and V ``num_stages`` times)."""
    if cfg.chunk_kernel == "pingpong":
        block_n, stages = pingpong_tile(cfg)
        return (128 + 2 * stages * block_n) * problem.head_dim * problem.itemsize + 1024
    r = resolve(problem, cfg)
    return kernel_smem(problem, r["block_m"], r["block_n"], r["num_stages"])


def pingpong_tile(cfg: UnifiedAttentionConfig) -> tuple[int, int]:
    """``(BLOCK_N, STAGES)`` of the ping-pong kernel from ``cfg``'s ``fwd_params``
    (:data:`PINGPONG_TILE`'s where 0); a ``ValueError`` for a tile it does not take."""
    p = cfg.fwd_params
    block_n = p.kv_blocksize or PINGPONG_TILE.kv_blocksize
    stages = p.num_stages or PINGPONG_TILE.num_stages
    if p.q_blocksize not in (None, 0, 128) or block_n not in (64, 128) or stages not in (2, 3):
        raise ValueError(
            "chunk_kernel='pingpong' takes fwd_params q_blocksize 128, kv_blocksize 64 or 128 "
            f"and num_stages 2 or 3, not {p}"
        )
    return block_n, stages


def pingpong_refusal(kw: Mapping[str, Any], problem: Problem, query: str) -> str | None:
    """Why the ping-pong kernel cannot serve this call's chunks, or ``None``: it needs a Hopper
    GPU (sm_90), a batch that is not decode-like, bfloat16 or float16 queries and caches of
    that dtype, D = Dv of 64 or 128, pages of a power of two of at least 8 slots, a softmax
    scale > 0, and none of a sliding window, sinks, ALiBi slopes, cache scales or sequence
    starts."""
    if _launch.interpreting():
        return "the interpreter does not run Gluon kernels"
    if flash_attention_config._compute_capability() != (9, 0):
        return "Hopper (sm_90) only"
    if problem.decode_like:
        return "a decode-like batch (at most two queries a sequence on average)"
    dtype = jnp.dtype(kw[query].dtype)
    caches = (jnp.dtype(kw["key_cache"].dtype), jnp.dtype(kw["value_cache"].dtype))
    if dtype not in (jnp.bfloat16, jnp.float16) or caches != (dtype, dtype):
        return f"{query} and caches in one of bfloat16 and float16, not {dtype}, {caches}"
    d, dv = problem.head_dim, int(kw["value_cache"].shape[-1])
    if d not in (64, 128) or dv != d:
        return f"head dims {d}, {dv} (64 or 128, equal)"
    ps = problem.page_size
    if ps < 8 or ps & (ps - 1):
        return f"page size {ps} (a power of two, at least 8)"
    for name in ("sliding_window", "softmax_aux", "alibi_slopes", "k_scale", "v_scale"):
        if kw.get(name) is not None:
            return f"{name} is given"
    if kw.get("sequence_start") is not None:
        return "sequence_start is given"
    scale = kw.get("softmax_scale")
    if scale is not None and float(scale) <= 0:
        return f"softmax_scale {scale} (the kernel takes a scale > 0)"
    return None


def heuristic_config(problem: Problem, config: type[Any], *, pingpong: bool = False) -> Any:
    """The heuristic's settings, spelled out in ``config``'s class (``pingpong``: the call is
    one the ping-pong kernel serves, which then takes the chunks)."""
    if pingpong:
        return config(fwd_params=PINGPONG_TILE, num_splits=1, chunk_kernel="pingpong")
    r = resolve(problem, None)
    return config(
        fp8_v_words=_v_words_apply(problem),
        fwd_params=FwdParams(
            q_blocksize=r["block_m"],
            kv_blocksize=r["block_n"],
            num_warps=r["num_warps"],
            num_stages=fit_stages(problem, r["block_m"], r["block_n"], r["num_stages"]),
        ),
        num_splits=r["num_splits"],
    )


def _v_words_apply(problem: Problem) -> bool:
    """Whether ``fp8_v_words`` can apply: a float8 cache whose head dim is a multiple of 16.
    Where it can, the heuristic takes it: faster than V's byte loads at every decode batch
    timed (RESULTS.md)."""
    return problem.itemsize == 1 and problem.head_dim % 16 == 0


#: Tiles the config space tries beside the heuristic's: (rows, keys, warps, stages).
_TILES = (
    (16, 16, 4, 4),
    (16, 32, 4, 4),
    (16, 64, 4, 3),
    (16, 128, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 32, 8, 3),
)


def config_space_of(problem: Problem, config: type[Any], *, pingpong: bool = False) -> list[Any]:
    """The heuristic's config; its tile with twice and half the splits (decode) or none; a
    few other tiles at the heuristic's splits; a mixed batch's decodes in a launch of their
    own; where ``pingpong``, the ping-pong kernel's tiles; minus those over the device's
    shared memory."""
    base = heuristic_config(problem, config)
    if _launch.interpreting() or problem.itemsize == 4:
        return [base]
    chunks = []
    if pingpong:
        for keys, stages in ((128, 2), (128, 3), (64, 3)):
            params = FwdParams(q_blocksize=128, kv_blocksize=keys, num_warps=4, num_stages=stages)
            chunks.append(config(fwd_params=params, num_splits=1, chunk_kernel="pingpong"))
    splits = base.num_splits
    configs = [base]
    for n in {1, max(1, splits // 2), min(MAX_SPLITS, splits * 2)} - {splits}:
        configs.append(attrs.evolve(base, num_splits=n))
    for rows, keys, warps, stages in _TILES:
        params = FwdParams(q_blocksize=rows, kv_blocksize=keys, num_warps=warps, num_stages=stages)
        configs.append(attrs.evolve(base, fwd_params=params))
    if not problem.decode_like and problem.rows > 1:
        configs.append(attrs.evolve(base, decode_launch=True))
    if _v_words_apply(problem):
        configs.append(attrs.evolve(base, fp8_v_words=False))
    return prune_by_shared_memory(
        list(dict.fromkeys([*chunks, *configs])),
        functools.partial(smem_need, problem),
        keep=(chunks or [base])[:1],
        what="serving attention (triton)",
    )


def table_problem(query: str) -> Callable[[Mapping[str, Any]], Problem]:
    """The :class:`Problem` of a call over ``block_tables [rows, max_pages]`` whose queries are
    the argument ``query``."""

    def problem(kw: Mapping[str, Any]) -> Problem:
        tables = kw["block_tables"]
        return Problem.of(kw[query], kw["key_cache"], tables.shape[0], tables.shape[1])

    return problem


def tuning(
    config: type[Any], problem: Callable[[Mapping[str, Any]], Problem], query: str | None = None
) -> tuple[Callable[[Any], Any], Callable[[Any], list[Any]]]:
    """An op's ``(heuristic, config_space)`` for ``config``'s class on ``problem(inv.kwargs)``;
    with the name of its ``query`` argument, the ping-pong kernel serves chunks where it can."""

    def pingpong(inv: Any, p: Problem) -> bool:
        return query is not None and pingpong_refusal(inv.kwargs, p, query) is None

    def heuristic(inv: Any) -> Any:
        """Rows, keys per step and splits from the batch's shape (see the module's notes)."""
        p = problem(inv.kwargs)
        return heuristic_config(p, config, pingpong=pingpong(inv, p))

    def config_space(inv: Any) -> list[Any]:
        """The heuristic's config and a few neighbours, pruned by shared memory."""
        p = problem(inv.kwargs)
        return config_space_of(p, config, pingpong=pingpong(inv, p))

    return heuristic, config_space


def selection(
    config: type[Any],
    problem: Callable[[Mapping[str, Any]], Problem],
    query: str,
    caches: tuple[str, str] = ("key_cache", "value_cache"),
) -> tuple[Callable[[Any], Any], Callable[[Any], list[Any]], Callable[[Any], bool | str]]:
    """A serving op's ``(heuristic, config_space, supports)``: :func:`tuning` of ``config`` on
    ``problem``, and :func:`serving_supports` of its query argument ``query`` and ``caches``."""
    heuristic, config_space = tuning(config, problem, query)

    def supports(inv: Any) -> bool | str:
        """True, or why not (dtypes, head dims over 256)."""
        return serving_supports(inv.kwargs, query, caches)

    return heuristic, config_space, supports


def serving_supports(
    kw: Mapping[str, Any], query: str, caches: tuple[str, str] = ("key_cache", "value_cache")
) -> bool | str:
    """True, or why not: query dtypes other than bfloat16/float16/float32, cache dtypes other
    than those and ``float8_e4m3fn``, float8 caches on a GPU without float8 conversions
    (before sm_89), head dims over 256."""
    x = kw[query]
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"{query} dtype {x.dtype} (Triton kernels take bfloat16, float16, float32)"
    for name in caches:
        x = kw[name]
        if jnp.dtype(x.dtype) == _FP8:
            capability = flash_attention_config._compute_capability()
            if not _launch.interpreting() and capability < (8, 9):
                return f"{name}: float8_e4m3fn caches need sm_89 or later"
        elif jnp.dtype(x.dtype) not in _DTYPES:
            return (
                f"{name} dtype {x.dtype} (Triton kernels take bfloat16, float16, float32, "
                "float8_e4m3fn)"
            )
    d = int(kw[caches[0]].shape[-1])
    if d > _MAX_HEAD_DIM:
        return f"head dim {d} > {_MAX_HEAD_DIM}"
    dv = int(kw[caches[1]].shape[-1])
    if dv > _MAX_HEAD_DIM:
        return f"value head dim {dv} > {_MAX_HEAD_DIM}"
    return True
