"""What the Triton serving-attention tests share: small tiles, a packed paged batch with
NaN in every cache slot no sequence owns (in NumPy, and as the ops take it), and the
finite-and-close check."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ejkernel.ops import FwdParams
from ejkernel.specs._paged import paged_block_tables
from ejkernel.testing import assert_close
from ejkernel_triton.ops.unified_attention import UnifiedAttentionConfig


def small(rows: int = 16, keys: int = 16, splits: int = 1) -> UnifiedAttentionConfig:
    """Tiles small enough that the interpreter's batches cross several of them."""
    params = FwdParams(q_blocksize=rows, kv_blocksize=keys, num_warps=4, num_stages=1)
    return UnifiedAttentionConfig(fwd_params=params, num_splits=splits)


def packed_batch(
    kv_lens: list[int],
    q_lens: list[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    page_size: int,
    max_pages: int | None = None,
    extra_rows: int = 0,
    pad_tokens: int = 0,
    cache_scale: float = 1.0,
    seed: int = 0,
) -> tuple[np.random.Generator, dict[str, np.ndarray]]:
    """A packed batch in NumPy float32 and the generator that drew it (for further draws).

    Pages shuffled, garbage ids past the live pages, NaN in every cache slot no sequence owns
    (caches drawn times ``cache_scale``); ``extra_rows`` table rows past the live sequences
    (with lengths and pages of their own that must not be read), ``pad_tokens`` tokens of no
    sequence."""
    rng = np.random.default_rng(seed)
    all_lens = list(kv_lens) + [page_size + 3] * extra_rows
    max_pages = max_pages or max(1, max(-(-n // page_size) for n in all_lens)) + 1
    num_pages = sum(-(-n // page_size) for n in all_lens) + 3
    tables = paged_block_tables(
        rng, all_lens, num_pages=num_pages, page_size=page_size, max_pages=max_pages,
        unused=(10**6, -1),
    )  # fmt: skip
    shape = (num_pages, page_size, hkv, d)
    kc = rng.standard_normal(shape).astype(np.float32) * cache_scale
    vc = rng.standard_normal(shape).astype(np.float32) * cache_scale
    owned = np.zeros((num_pages, page_size), bool)
    for s, n in enumerate(kv_lens):
        for p in range(n):
            owned[tables[s, p // page_size], p % page_size] = True
    kc[~owned], vc[~owned] = np.nan, np.nan
    t = sum(q_lens) + pad_tokens
    qsl = np.concatenate([[0], np.cumsum(q_lens + [0] * extra_rows)])
    return rng, {
        "queries": rng.standard_normal((t, hq, d)),
        "key_cache": kc,
        "value_cache": vc,
        "kv_lens": np.asarray(all_lens, np.int32),
        "block_tables": tables,
        "query_start_loc": qsl,
    }


def packed(
    kv_lens: list[int],
    q_lens: list[int],
    *,
    hq: int = 4,
    hkv: int = 2,
    d: int = 64,
    page_size: int = 16,
    max_pages: int | None = None,
    extra_rows: int = 0,
    pad_tokens: int = 0,
    dtype: Any = jnp.float32,
    cache_dtype: Any = None,
    cache_scale: float = 1.0,
    new_tokens: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """:func:`packed_batch` as the ops take it: queries in ``dtype``, caches in
    ``cache_dtype`` (default ``dtype``); with ``new_tokens``, the new ``keys``/``values``
    ``[T, Hkv, D]`` of ``ragged_page_attention_v3`` (drawn after the batch, times
    ``cache_scale``, in ``dtype``)."""
    rng, batch = packed_batch(
        kv_lens, q_lens, hq=hq, hkv=hkv, d=d, page_size=page_size, max_pages=max_pages,
        extra_rows=extra_rows, pad_tokens=pad_tokens, cache_scale=cache_scale, seed=seed,
    )  # fmt: skip
    cache_dtype = cache_dtype or dtype
    dtypes = {"queries": dtype, "key_cache": cache_dtype, "value_cache": cache_dtype}
    dtypes["query_start_loc"] = jnp.int32
    out = {n: jnp.asarray(x, dtypes.get(n)) for n, x in batch.items()}
    if new_tokens:
        t = batch["queries"].shape[0]
        for name in ("keys", "values"):
            out[name] = jnp.asarray(rng.standard_normal((t, hkv, d)) * cache_scale, dtype)
    return out


def check(actual: Any, expected: Any, dtype: Any = jnp.float32) -> None:
    """``actual`` finite and close to ``expected`` at ``dtype``'s tolerance."""
    assert bool(jnp.all(jnp.isfinite(actual))), "non-finite output"
    assert_close(actual, expected, dtype=dtype)


def hopper_launch(
    cache: Any,
    *,
    tokens: int,
    hq: int,
    rows: int,
    max_pages: int,
    query_start_loc: Any,
    decode: bool = False,
    **options: Any,
) -> Any:
    """The one launch of ``paged_attention`` on ``tokens`` bfloat16 queries of ones over
    ``cache`` (``rows`` sequences of ``max_pages`` pages), compiled for sm_90."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops.unified_attention import paged_attention

    with _codegen.recorded_launches() as record:
        paged_attention(
            None,
            {
                "queries": jnp.ones((tokens, hq, cache.shape[-1]), jnp.bfloat16),
                "key_cache": cache,
                "value_cache": cache,
                "kv_lens": jnp.ones((rows,), jnp.int32),
                "block_tables": jnp.zeros((rows, max_pages), jnp.int32),
                "query_start_loc": query_start_loc,
                "num_seqs": rows,
                **options,
            },
            decode=decode,
        )
    (launch,) = record
    return _codegen.compile_launch(launch, capability=90)


def assert_pipelined_matrix_code(compiled: Any) -> None:
    """``compiled``'s PTX: 16-byte pipelined copies, no 2-byte or 1-byte loads, and matrix
    instructions."""
    from ejkernel_triton import _codegen

    mix = _codegen.instruction_mix(compiled.ptx)
    assert not {k: n for k, n in mix.items() if k.endswith((".b16", ".u16", ".b8"))}, mix
    assert mix.get("cp.async.cg.shared.global", 0) > 0, mix
    assert any(k.startswith(("wgmma", "mma")) for k in mix), mix
