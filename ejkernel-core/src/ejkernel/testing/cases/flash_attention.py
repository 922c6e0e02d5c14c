"""Conformance examples of ``flash_attention``: GQA/MQA, odd sizes, every mask and option."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid
from ejkernel.testing.cases._common import attention_example, segment_ids

__all__ = ["attention_examples", "examples", "invalid_attention"]


def _segments(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    b, sq = values["query"].shape[:2]
    sk = values["key"].shape[1]
    return {
        "q_segment_ids": segment_ids(rng, b, sq, pad=3),
        "kv_segment_ids": segment_ids(rng, b, sk, pad=5),
    }


def attention_examples(*, dropout: bool, sinks: bool) -> list[Example]:
    """The attention family's examples (``dropout``/``sinks``: the op takes them)."""
    masks: dict[str, tuple[tuple[int, ...], str]] = {
        "attention_mask": ((1, 1, 37, 129), "bool"),
        "bias": ((1, 4, 37, 129), FLOAT),
        "q_segment_ids": ((1, 37), "int32"),
        "kv_segment_ids": ((1, 129), "int32"),
    }
    if sinks:
        masks["softmax_aux"] = ((4,), FLOAT)
    cases = [
        attention_example(
            (2, 37, 37, 4, 2, 80),
            tags="causal-softcap",
            options={"causal": True, "logits_soft_cap": 20.0},
        ),
        attention_example(
            (1, 37, 129, 4, 1, 64, 48),
            tags="masks-bias-segments-window" + ("-sinks" if sinks else ""),
            extra=masks,
            options={"sliding_window": (16, 8), "softmax_scale": 0.2},
            fill=_segments,
        ),
        attention_example(
            (1, 129, 129, 8, 2, 64),
            tags="causal-window",
            options={"causal": True, "sliding_window": 24},
            thorough=True,
        ),
    ]
    if dropout:
        cases.append(
            attention_example(
                (1, 1, 129, 8, 2, 64),
                tags="decode-causal-dropout" + ("-sinks2" if sinks else ""),
                extra={"softmax_aux": ((8, 2), FLOAT)} if sinks else None,
                options={"causal": True, "dropout_prob": 0.25, "dropout_seed": 7},
            )
        )
    return cases


def invalid_attention() -> list[Invalid]:
    """Changes every attention op must reject."""
    return [
        Invalid.extra_axis("query"),
        Invalid.replace(
            "key-heads-not-dividing-query-heads",
            key=lambda a: jnp.repeat(a["key"][:, :, :1], 3, axis=2),
            value=lambda a: jnp.repeat(a["value"][:, :, :1], 3, axis=2),
        ),
        Invalid.replace("key-dtype-differs", key=lambda a: a["key"].astype(jnp.bfloat16)),
    ]


def examples() -> list[Example | Invalid]:
    return [*attention_examples(dropout=True, sinks=True), *invalid_attention()]
