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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel.ops import FwdParams, prune_by_shared_memory
from ejkernel_triton import _launch, _smem
from ejkernel_triton.ops.flash_attention_config import (
    _compute_capability,
    _sm_count,
    fwd_smem,
    pow2,
)

__all__ = [
    "MAX_SPLITS",
    "MIN_SPLIT_KEYS",
    "Problem",
    "UnifiedAttentionConfig",
    "fit_stages",
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
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    num_splits: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    decode_launch: bool = False


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
    """Bytes of shared memory ``cfg``'s kernel asks for on ``problem``."""
    r = resolve(problem, cfg)
    return kernel_smem(problem, r["block_m"], r["block_n"], r["num_stages"])


def heuristic_config(problem: Problem, config: type[Any]) -> Any:
    """The heuristic's settings, spelled out in ``config``'s class."""
    r = resolve(problem, None)
    return config(
        fwd_params=FwdParams(
            q_blocksize=r["block_m"],
            kv_blocksize=r["block_n"],
            num_warps=r["num_warps"],
            num_stages=fit_stages(problem, r["block_m"], r["block_n"], r["num_stages"]),
        ),
        num_splits=r["num_splits"],
    )


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


def config_space_of(problem: Problem, config: type[Any]) -> list[Any]:
    """The heuristic's config; its tile with twice and half the splits (decode) or none; a
    few other tiles at the heuristic's splits; a mixed batch's decodes in a launch of their
    own; minus those over the device's shared memory."""
    base = heuristic_config(problem, config)
    if _launch.interpreting() or problem.itemsize == 4:
        return [base]
    splits = base.num_splits
    configs = [base]
    for n in {1, max(1, splits // 2), min(MAX_SPLITS, splits * 2)} - {splits}:
        configs.append(attrs.evolve(base, num_splits=n))
    for rows, keys, warps, stages in _TILES:
        params = FwdParams(q_blocksize=rows, kv_blocksize=keys, num_warps=warps, num_stages=stages)
        configs.append(attrs.evolve(base, fwd_params=params))
    if not problem.decode_like and problem.rows > 1:
        configs.append(attrs.evolve(base, decode_launch=True))
    return prune_by_shared_memory(
        list(dict.fromkeys(configs)),
        functools.partial(smem_need, problem),
        keep=(base,),
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
    config: type[Any], problem: Callable[[Mapping[str, Any]], Problem]
) -> tuple[Callable[[Any], Any], Callable[[Any], list[Any]]]:
    """An op's ``(heuristic, config_space)`` for ``config``'s class on ``problem(inv.kwargs)``."""

    def heuristic(inv: Any) -> Any:
        """Rows, keys per step and splits from the batch's shape (see the module's notes)."""
        return heuristic_config(problem(inv.kwargs), config)

    def config_space(inv: Any) -> list[Any]:
        """The heuristic's config and a few neighbours, pruned by shared memory."""
        return config_space_of(problem(inv.kwargs), config)

    return heuristic, config_space


def selection(
    config: type[Any],
    problem: Callable[[Mapping[str, Any]], Problem],
    query: str,
    caches: tuple[str, str] = ("key_cache", "value_cache"),
) -> tuple[Callable[[Any], Any], Callable[[Any], list[Any]], Callable[[Any], bool | str]]:
    """A serving op's ``(heuristic, config_space, supports)``: :func:`tuning` of ``config`` on
    ``problem``, and :func:`serving_supports` of its query argument ``query`` and ``caches``."""
    heuristic, config_space = tuning(config, problem)

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
            if not _launch.interpreting() and _compute_capability() < (8, 9):
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
