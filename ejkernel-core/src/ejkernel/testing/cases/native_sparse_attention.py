"""Conformance examples of ``native_sparse_attention``: selection from the compressed scores
(float32 only: bfloat16 logits may reorder near-tied blocks), given block indices (with empty
slots), packed sequences, the sliding-window branch."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def _arrays(b: int, s: int, hq: int, hkv: int, d: int, *, swa: bool) -> dict[str, Any]:
    arrays = {
        "query": ((b, s, hq, d), FLOAT),
        "key": ((b, s, hkv, d), FLOAT),
        "value": ((b, s, hkv, d), FLOAT),
        "g_cmp": ((b, s, hq), FLOAT),
        "g_slc": ((b, s, hq), FLOAT),
    }
    if swa:
        arrays["g_swa"] = ((b, s, hq), FLOAT)
    return arrays


def _indices(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Past blocks (causal), some slots empty (-1), one repeated."""
    b, s, hkv, t = values["block_indices"].shape
    block = 16
    own = np.arange(s) // block
    idx = rng.integers(0, np.maximum(own, 0)[None, :, None, None] + 1, size=(b, s, hkv, t))
    idx[..., -1] = -1
    idx[..., 0] = own[None, :, None]
    return {"block_indices": idx.astype(np.int32)}


def _packed(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    del rng
    return {"cu_seqlens": np.array([0, 13, 40, 41, 70], np.int32)}


def examples() -> list[Example | Invalid]:
    return [
        Example(
            name="B2-S37-Hq4-Hkv2-D32-block16-count2-window8-selected",
            arrays=_arrays(2, 37, 4, 2, 32, swa=True),
            options={"block_size": 16, "block_counts": 2, "window_size": 8},
            dtypes=("float32",),
        ),
        Example(
            name="B1-S70-Hq4-Hkv1-D80-block16-given-indices-packed",
            arrays={
                **_arrays(1, 70, 4, 1, 80, swa=False),
                "block_indices": ((1, 70, 1, 3), "int32"),
                "cu_seqlens": ((5,), "int32"),
            },
            options={"block_size": 16, "softmax_scale": 0.4},
            fill=lambda v, rng: {**_indices(v, rng), **_packed(v, rng)},
        ),
        Invalid.extra_axis("query"),
        Invalid.replace("g_cmp-wrong-heads", g_cmp=lambda a: a["g_cmp"][..., :1]),
    ]
