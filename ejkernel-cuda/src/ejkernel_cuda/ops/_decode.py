"""The native split-K decode kernel shared by ``ragged_decode_attention`` and ``page_attention``.

Both ops are one query per row over a range ``[lo, hi)`` of that row's cache positions; a
dense cache ``[B, Sk, Hkv, D]`` is the paged layout with ``page_size = Sk`` and page ``b`` for
row ``b``, so one FFI target (``ejkernel_decode_attention``, ``csrc/decode_attention.cu``)
serves both. The callers fold clamping and the sliding window into ``lo``/``hi``.

Config: ``num_splits``, the key-range splits per row (flash decoding's split-K). The heuristic
takes the fewest splits whose CTAs fill at least 90 % of the resident slots of their last wave
(at least 128 keys per split): on an H100, B 32, 32/8 heads, 8192 keys (256 CTAs per split,
528 slots), 2 splits read at 92 % of the copy bandwidth, 3 (1.45 waves) at 78 %, 4 and 8 at
90 %, 9 (the old "16 CTAs per SM" rule) at 86 %, 16 at 82 %.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_cuda.ops._limits import declined_dtype_or_head_dims

__all__ = [
    "DecodeConfig",
    "decode",
    "decode_supports",
    "decode_tuning",
    "heads_per_cta",
]

#: Head dims the kernel serves: multiples of 8 up to this.
MAX_HEAD_DIM = 256
DTYPES = ("bfloat16", "float16", "float32")
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 64
#: Resident split-kernel CTAs per SM by cache element size (``MIN_BLOCKS`` of ``DecodeTile`` in
#: csrc/decode_attention.cu: its shared-memory ring and register cap).
RESIDENT_CTAS = {2: 4, 4: 3}
#: Smallest fill of the last wave's slots the heuristic accepts.
WAVE_FILL = 0.9


@attrs.frozen(kw_only=True)
class DecodeConfig:
    """``num_splits``: key-range splits per row; 0 picks the heuristic's count at call time."""

    num_splits: int = attrs.field(default=0, validator=attrs.validators.ge(0))


def heads_per_cta(hq: int, hkv: int) -> int:
    """Query heads one CTA serves from each K/V read: the largest of 4, 2, 1 dividing the
    GQA group (mirrors ``launch_decode`` in csrc/decode_attention.cu)."""
    group = hq // hkv
    return next(h for h in (4, 2, 1) if group % h == 0)


def default_splits(rows: int, hq: int, hkv: int, capacity: int, itemsize: int = 2) -> int:
    """The fewest splits whose CTAs fill ``WAVE_FILL`` of the slots of every wave they take
    (``MAX_SPLITS`` at most, ``MIN_KEYS_PER_SPLIT`` keys each); failing that, the count that
    fills them best."""
    from ejkernel_cuda._device import sm_count

    slots = sm_count() * RESIDENT_CTAS.get(itemsize, 4)
    ctas = max(rows * (hq // heads_per_cta(hq, hkv)), 1)
    most = max(1, min(MAX_SPLITS, capacity // MIN_KEYS_PER_SPLIT))

    def fill(splits: int) -> float:
        n = ctas * splits
        return n / (math.ceil(n / slots) * slots)

    for splits in range(1, most + 1):
        if fill(splits) >= WAVE_FILL:
            return splits
    return max(range(1, most + 1), key=fill)


#: ``(rows, hq, hkv, capacity, cache itemsize)`` of a call: what the split count depends on.
Dims = tuple[int, int, int, int, int]


def decode_tuning(
    dims: Callable[[Mapping[str, Any]], Dims], config: type
) -> tuple[Callable[[Any], Any], Callable[[Any], list[Any]]]:
    """An op's ``heuristic`` and ``config_space`` from ``dims(kwargs)`` and its config class."""

    def heuristic(inv: Any) -> Any:
        """The fewest splits that fill the GPU's resident CTA slots (``default_splits``)."""
        return config(num_splits=default_splits(*dims(inv.kwargs)))

    def config_space(inv: Any) -> list[Any]:
        """One split, the heuristic's, and powers of two up to the keys' limit."""
        rows, hq, hkv, capacity, itemsize = dims(inv.kwargs)
        most = max(1, min(MAX_SPLITS, capacity // MIN_KEYS_PER_SPLIT))
        counts = {1, default_splits(rows, hq, hkv, capacity, itemsize)}
        counts.update(n for n in (2, 4, 8, 16, 32, 64) if n <= most)
        return [config(num_splits=n) for n in sorted(counts)]

    return heuristic, config_space


def decode_supports(query: Any, value: Any, k_scale: Any = None, v_scale: Any = None) -> bool | str:
    """Scaled caches, shape and dtype limits of the kernel, then whether it is built (first use
    builds)."""
    if k_scale is not None or v_scale is not None:
        return "the CUDA decode kernel reads no scaled caches (k_scale/v_scale, float8_e4m3fn)"
    declined = declined_dtype_or_head_dims(
        "the CUDA decode kernel", DTYPES, MAX_HEAD_DIM, query, value
    )
    if declined:
        return declined
    from ejkernel_cuda._build import native_status

    return native_status()


#: ``bounds(first, second, capacity, left) -> (lo, hi)``: an op's visible range per row.
Bounds = Callable[[jax.Array, Any, int, Any], tuple[jax.Array, jax.Array]]


def decode(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    per_row: tuple[jax.Array, jax.Array | None],
    *,
    bounds: Bounds,
    table: jax.Array | None,
    softmax_aux: jax.Array | None,
    dims: Dims,
    cfg: DecodeConfig | None,
    options: Mapping[str, Any],
) -> jax.Array:
    """A decode op's forward: ``bounds`` turns the ``per_row`` arrays into each row's
    ``[lo, hi)`` (clamped, windowed by ``sliding_window``'s left), then the kernel with ``options``' scale and soft cap and ``cfg``'s splits (0 or ``None``: the heuristic's)."""
    from ejkernel_cuda._build import require_native

    require_native()
    splits = cfg.num_splits if cfg is not None and cfg.num_splits > 0 else 0
    scale, window = options.get("softmax_scale"), options.get("sliding_window")
    return _decode(
        query,
        key_cache,
        value_cache,
        *per_row,
        table,
        softmax_aux,
        bounds=bounds,
        scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
        cap=options.get("logits_soft_cap"),
        left=None if window is None else int(window[0]),
        splits=int(splits or default_splits(*dims)),
    )


@functools.partial(jax.jit, static_argnames=("bounds", "scale", "cap", "left", "splits"))
def _decode(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    first: jax.Array,
    second: jax.Array | None,
    table: jax.Array | None,
    softmax_aux: jax.Array | None,
    *,
    bounds: Bounds,
    scale: float,
    cap: float | None,
    left: int | None,
    splits: int,
) -> jax.Array:
    """Launch the FFI target: ``[R, Hq, D]`` out over ``[lo, hi)`` of each row's cache.

    Args:
        query: [R, Hq, D].
        key_cache, value_cache: [P, page_size, Hkv, D] (dense: [R, Sk, Hkv, D]).
        first, second: the per-row arrays ``bounds`` reads (``second`` may be ``None``).
        table: [R, max_pages] int page ids, or ``None`` for a dense cache.
        softmax_aux: [Hq] or [Hq, n] sink logits, or ``None``.
        scale, cap: the softmax scale and logits soft cap.
        left: the sliding window's left extent, or ``None``.
        splits: key-range splits per row (>= 1).
    """
    capacity = key_cache.shape[1] * (1 if table is None else table.shape[1])
    lo, hi = bounds(first, second, capacity, left)
    r, hq, d = query.shape
    aux = (
        jnp.zeros((1, 1), jnp.float32)
        if softmax_aux is None
        else softmax_aux.astype(jnp.float32).reshape(hq, -1)
    )
    tab = jnp.zeros((1, 1), jnp.int32) if table is None else table.astype(jnp.int32)
    out_types = (
        jax.ShapeDtypeStruct((r, hq, d), query.dtype),
        jax.ShapeDtypeStruct((r, hq, splits, d), jnp.float32),
        jax.ShapeDtypeStruct((r, hq, splits, 2), jnp.float32),
    )
    call = jax.ffi.ffi_call("ejkernel_decode_attention", out_types, vmap_method="sequential")
    out, _, _ = call(
        query,
        key_cache,
        value_cache,
        lo.astype(jnp.int32),
        hi.astype(jnp.int32),
        tab,
        aux,
        softmax_scale=np.float32(scale),
        soft_cap=np.float32(cap or 0.0),
        num_splits=np.int64(splits),
        paged=np.int64(table is not None),
        has_aux=np.int64(softmax_aux is not None),
    )
    return out
