"""Numerics examples of the linear-attention and state-space ops: what their sequential
recurrence makes of a log gate of -inf (a state reset), of a NaN at one token (it reaches only
that token's causal future: the kit's comparison passes NaN only where the reference has NaN
and wants every other output finite and close), of log decays of -20 per step over 101 steps,
and of zero-length packed sequences."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ejkernel.testing._examples import Example
from ejkernel.testing.cases._common import arrays_of, sizes_id
from ejkernel.testing.cases._linear import linear_example

__all__ = [
    "PACKED_WITH_EMPTY",
    "RESET_TOKENS",
    "TOKEN",
    "linear_numerics",
    "nan_entry",
    "set_tokens",
    "state_space_numerics",
]

#: The token that carries the NaN; the resets are at it and two tokens later (two resets
#: inside one chunk of 16 or more), and at the last token.
TOKEN = 21
RESET_TOKENS = (TOKEN, TOKEN + 2, 36)
#: Packed sequences of 0, 13, 0, 0, 27, 1, 29 and 0 tokens.
PACKED_WITH_EMPTY = (0, 0, 13, 13, 13, 40, 41, 70, 70)

Fill = Callable[[dict[str, Any], np.random.Generator], Mapping[str, Any]]


def set_tokens(
    value: float, names: tuple[str, ...], tokens: tuple[int, ...] | None, *, entry: bool = False
) -> Fill:
    """A ``fill`` setting ``names`` at ``tokens`` (axis 1; every token when ``None``) to
    ``value``; ``entry``: only the entry ``[..., 1, ..., 1]`` of each token (one channel)."""

    def fill(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del rng
        out = {}
        for name in names:
            x = np.array(values[name], np.float32)
            at: tuple[Any, ...] = (slice(None), slice(None) if tokens is None else list(tokens))
            if entry:
                at += (1,) * (x.ndim - 2)
            x[at] = value
            out[name] = x
        return out

    return fill


def nan_entry(name: str) -> dict[str, Any]:
    """The ``fill``, ``dtypes`` and ``grad`` of a NaN example: one entry of ``name`` at
    :data:`TOKEN` is NaN, in float32 only, with no gradients (they are NaN wherever the NaN
    reaches)."""
    return {
        "fill": set_tokens(np.nan, (name,), (TOKEN,), entry=True),
        "dtypes": ("float32",),
        "grad": False,
    }


def linear_numerics(
    *,
    extra: dict[str, str],
    gates: tuple[str, ...],
    reset: Fill | None = None,
    strong: Fill | None = None,
    prefix: str = "",
    **kwargs: Any,
) -> list[Example]:
    """The numerics examples of a linear-attention op whose ``extra`` arrays hold the log
    ``gates``: gates of -inf at :data:`RESET_TOKENS` (``reset`` instead when given), a NaN
    value at :data:`TOKEN` (no gradients: every one is NaN), log decays of -20 per step over
    101 tokens (``strong`` instead when given), and packed sequences with empty ones
    (:data:`PACKED_WITH_EMPTY`) and initial states. Their tags start with ``prefix``;
    ``kwargs`` go to every example."""
    state = {"initial_state": "[N, H, K, V]"}
    options = kwargs.pop("options", {})
    return_state = {**options, "return_state": True}
    return [
        linear_example(
            tags=f"{prefix}reset",
            extra={**extra, **state},
            options=return_state,
            fill=reset or set_tokens(-np.inf, gates, RESET_TOKENS),
            dtypes=("float32",),
            **kwargs,
        ),
        linear_example(
            b=1,
            tags=f"{prefix}nan-value",
            extra=extra,
            options=options,
            **nan_entry("value"),
            **kwargs,
        ),
        linear_example(
            b=1,
            s=101,
            h=2,
            k=8,
            v=8,
            tags=f"{prefix}decay-20",
            extra={**extra, **state},
            options=return_state,
            fill=strong or set_tokens(-20.0, gates, None),
            dtypes=("float32",),
            **kwargs,
        ),
        linear_example(
            tags=f"{prefix}empty-sequences",
            extra={**extra, **state},
            options=return_state,
            packed_sequences=PACKED_WITH_EMPTY,
            dtypes=("float32",),
            **kwargs,
        ),
    ]


def state_space_numerics(
    sizes: Mapping[str, int], *, core: dict[str, str], options: dict[str, Any]
) -> list[Example]:
    """The numerics examples of a state-space op of ``sizes`` (``core`` arrays by their
    letters): ``A = -inf`` on one head or channel (no memory there), a NaN entry of ``x`` at
    :data:`TOKEN` (no gradients), and ``Δ = 1``, ``A = -20`` (a log decay of -20 per step)
    over 101 tokens (one batch row)."""
    arrays = arrays_of(sizes, **core)
    long_sizes = {**sizes, "B": 1, "S": 101}
    long = arrays_of(long_sizes, **core)

    def no_memory(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del rng
        a = np.array(values["A"], np.float32)
        a[1] = -np.inf  # head 1 (state_space_v2) or channel 1 (state_space_v1)
        return {"A": a}

    def strong(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        del rng
        return {"A": np.full_like(values["A"], -20.0), "dt": np.ones_like(values["dt"])}

    name = sizes_id(sizes)
    return [
        Example(name=f"{name}-no-memory", arrays=arrays, options=options, fill=no_memory),
        Example(
            name=f"{name}-nan-x",
            arrays=arrays,
            options=options,
            **nan_entry("x"),
        ),
        Example(
            name=f"{sizes_id(long_sizes)}-decay-20",
            arrays=long,
            fill=strong,
            dtypes=("float32",),
        ),
    ]
