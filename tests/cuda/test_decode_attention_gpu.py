"""The native CUDA decode kernels (``ragged_decode_attention``, ``page_attention``) against the
references, on an NVIDIA GPU.

Inputs are hostile: NaN in every cache position no row may read, garbage page ids past the
live pages, ragged lengths 0, 1, a whole page and the whole cache, GQA groups that are not
powers of two, more splits than keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.plugins import get_registry
from ejkernel.specs._paged import paged_block_tables
from ejkernel.specs.page_attention import SPEC as PAGE_SPEC
from ejkernel.specs.page_attention import page_attention_reference
from ejkernel.specs.ragged_decode_attention import SPEC as RAGGED_SPEC
from ejkernel.specs.ragged_decode_attention import ragged_decode_attention_reference
from ejkernel.testing import assert_close
from ejkernel_cuda.ops.page_attention import PageAttentionConfig, page_attention_cuda
from ejkernel_cuda.ops.ragged_decode_attention import (
    RaggedDecodeAttentionConfig,
    ragged_decode_attention_cuda,
)

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def reference(fn: Any, **kw: Any) -> jax.Array:
    with jax.default_matmul_precision("highest"):
        return fn(**kw)


# -- ragged_decode_attention ---------------------------------------------------------------------


def ragged_inputs(
    b: int, sk: int, hq: int, hkv: int, d: int, dtype: Any, ranges: list[tuple[int, int]]
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, b, sk, hkv, d), np.float32)
    for row, (start, end) in enumerate(ranges):  # NaN wherever the row may not look
        k[:, row, : max(start, 0)] = np.nan
        k[:, row, max(end, 0) :] = np.nan
    return {
        "query": jnp.asarray(rng.standard_normal((b, hq, d), np.float32), dtype),
        "key": jnp.asarray(k[0], dtype),
        "value": jnp.asarray(k[1], dtype),
        "sequence_start": jnp.asarray([r[0] for r in ranges], jnp.int32),
        "sequence_end": jnp.asarray([r[1] for r in ranges], jnp.int32),
    }


#: Empty, length 1, the whole cache, odd ranges, a range ending at 1.
RANGES = [(0, 0), (7, 8), (0, 300), (13, 250), (299, 300), (0, 1), (100, 100)]


def check_ragged(
    dtype: Any = jnp.float32,
    hq: int = 8,
    hkv: int = 2,
    d: int = 128,
    cfg: Any = None,
    ranges: list[tuple[int, int]] = RANGES,
    **options: Any,
) -> jax.Array:
    arrays = ragged_inputs(len(ranges), 300, hq, hkv, d, dtype, ranges)
    args = RAGGED_SPEC.validate(RAGGED_SPEC.bind((), {**arrays, **options}))
    out = ragged_decode_attention_cuda(**args, cfg=cfg)
    assert out.shape == (len(ranges), hq, d) and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "NaN from an unread position"
    assert_close(out, reference(ragged_decode_attention_reference, **args), name=str(options))
    empty = np.asarray([e <= s for s, e in ranges])
    assert np.all(np.asarray(out, np.float32)[empty] == 0.0)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
def test_ragged_matches_the_reference_in_every_dtype(dtype: Any) -> None:
    check_ragged(dtype)


@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(32, 8, 128), (4, 1, 64), (12, 2, 80), (32, 2, 256), (3, 3, 8), (16, 1, 128)],
    ids=lambda v: str(v),
)
def test_ragged_head_layouts(hq: int, hkv: int, d: int) -> None:
    check_ragged(jnp.bfloat16, hq=hq, hkv=hkv, d=d)


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": (7, 0)},
        {"sliding_window": 0},
        {"logits_soft_cap": 2.0, "softmax_scale": 0.3},
        {"softmax_aux": "per-head"},
        {"softmax_aux": "two-per-head", "sliding_window": (40, 3)},
    ],
    ids=["window-7", "window-0", "softcap-scale", "sinks", "sinks2-window"],
)
def test_ragged_options_match_the_reference(options: dict[str, Any]) -> None:
    options = dict(options)
    aux = options.get("softmax_aux")
    if aux is not None:
        shape = (8,) if aux == "per-head" else (8, 2)
        options["softmax_aux"] = jnp.asarray(
            np.random.default_rng(1).standard_normal(shape), jnp.float32
        )
    check_ragged(jnp.float32, **options)


@pytest.mark.parametrize(("hq", "hkv"), [(8, 8), (8, 4), (8, 2), (16, 2)])
def test_ragged_soft_cap_in_every_head_grouping(hq: int, hkv: int) -> None:
    # 1, 2, 4 and 4 (two CTAs per KV head) query heads per CTA, each with the soft cap.
    check_ragged(jnp.float32, hq=hq, hkv=hkv, logits_soft_cap=1.5)
    check_ragged(jnp.bfloat16, hq=hq, hkv=hkv, d=80, logits_soft_cap=1.5)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_ragged_any_split_count_gives_the_same_result(splits: int) -> None:
    check_ragged(jnp.float32, cfg=RaggedDecodeAttentionConfig(num_splits=splits))


def _default_platform(op: str, record: Any) -> str:
    """The platform the default call should take: a shipped table's measured choice, else the
    Triton serving kernels where they are installed and serve (above the native decode), else
    this plugin's."""
    if record.reason.startswith("shipped table"):
        return str(record.platform)
    installed = {i.platform for i in get_registry().implementations(op)}
    return "triton" if "triton" in installed and "triton" not in record.rejected else "cuda"


def test_ragged_public_op_runs_on_cuda_under_jit_and_vmap() -> None:
    arrays = ragged_inputs(len(RANGES), 300, 8, 2, 64, jnp.bfloat16, RANGES)
    record = ejkernel.explain("ragged_decode_attention", *arrays.values())
    assert record.platform == _default_platform("ragged_decode_attention", record), record

    @jax.jit
    def run(q: jax.Array) -> jax.Array:
        call = lambda q: ejkernel.ragged_decode_attention(
            q,
            *[arrays[k] for k in ("key", "value", "sequence_start", "sequence_end")],
            platform="cuda",
        )
        return jax.vmap(call)(q)

    queries = jnp.stack([arrays["query"], -arrays["query"]])
    out = run(queries)
    for i in range(2):
        expected = reference(ragged_decode_attention_reference, **{**arrays, "query": queries[i]})
        assert_close(out[i], expected, name=f"example {i}")


# -- page_attention ------------------------------------------------------------------------------


def paged_inputs(
    kv_lens: tuple[int, ...],
    hq: int,
    hkv: int,
    d: int,
    page_size: int,
    max_pages: int,
    num_pages: int,
    *,
    dtype: Any,
) -> dict[str, Any]:
    """A paged cache holding the sequences' tokens; unowned slots hold NaN (never to be read)."""
    rng = np.random.default_rng(0)
    tables = paged_block_tables(
        rng,
        kv_lens,
        num_pages=num_pages,
        page_size=page_size,
        max_pages=max_pages,
        unused=(10**6, -1),
    )
    shape = (num_pages, page_size, hkv, d)
    owned = np.zeros(shape[:2], bool)
    for s, n in enumerate(kv_lens):
        for pos in range(n):
            owned[tables[s, pos // page_size], pos % page_size] = True
    caches = rng.standard_normal((2, *shape), np.float32)
    caches[:, ~owned] = np.nan
    return {
        "query": jnp.asarray(rng.standard_normal((len(kv_lens), hq, d), np.float32), dtype),
        "key_cache": jnp.asarray(caches[0], dtype),
        "value_cache": jnp.asarray(caches[1], dtype),
        "kv_lens": jnp.asarray(kv_lens, jnp.int32),
        "block_tables": jnp.asarray(tables),
    }


#: (kv_lens, hq, hkv, d, page_size, max_pages, num_pages): lengths 0 and 1, whole pages,
#: the whole table; odd page size 5; 16-token pages; MQA.
PAGED = {
    "gqa-page5": ((37, 0, 1, 5, 45, 23), 6, 2, 40, 5, 9, 48),
    "page16-full": ((16, 32, 1, 0, 128, 17), 8, 2, 128, 16, 8, 64),
    "mqa-page16": ((129, 16, 2, 64), 4, 1, 64, 16, 10, 33),
}


def check_paged(name: str, dtype: Any = jnp.float32, cfg: Any = None, **options: Any) -> None:
    kv_lens = PAGED[name][0]
    arrays = paged_inputs(*PAGED[name], dtype=dtype)
    args = PAGE_SPEC.validate(PAGE_SPEC.bind((), {**arrays, **options}))
    out = page_attention_cuda(**args, cfg=cfg)
    assert out.shape == arrays["query"].shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "garbage leaked into the output"
    assert_close(out, reference(page_attention_reference, **args), name=name)
    assert np.all(np.asarray(out, np.float32)[np.asarray(kv_lens) == 0] == 0.0)


@pytest.mark.parametrize("name", list(PAGED))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda t: jnp.dtype(t).name)
def test_paged_matches_the_reference(name: str, dtype: Any) -> None:
    check_paged(name, dtype)


@pytest.mark.parametrize(
    "options",
    [{"sliding_window": (7, 0)}, {"logits_soft_cap": 2.0, "softmax_scale": 0.5}],
    ids=["window-7", "softcap-scale"],
)
def test_paged_options_match_the_reference(options: dict[str, Any]) -> None:
    check_paged("gqa-page5", **options)
    check_paged("page16-full", **options)


@pytest.mark.parametrize("splits", [1, 5, 64])
def test_paged_any_split_count_gives_the_same_result(splits: int) -> None:
    check_paged("page16-full", cfg=PageAttentionConfig(num_splits=splits))


def test_paged_public_op_is_selected_on_the_gpu() -> None:
    arrays = paged_inputs(*PAGED["page16-full"], dtype=jnp.bfloat16)
    record = ejkernel.explain("page_attention", *arrays.values())
    assert record.platform == _default_platform("page_attention", record), record
    out = jax.jit(lambda a: ejkernel.page_attention(**a, platform="cuda"))(arrays)
    assert_close(out, reference(page_attention_reference, **arrays))
