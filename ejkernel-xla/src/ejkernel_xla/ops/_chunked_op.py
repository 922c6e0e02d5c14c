"""The op adapter that recurrent, gla and lightning_attention share on the chunked engine of
:mod:`ejkernel_xla.ops._chunked`: each op only names its config class, its tuning sizes and
its gates (how its arrays become the engine's float32 log gates).

The implementations are called with the op's arguments as keywords plus ``cfg`` (the core
spec lists and validates them); the non-array ones become the engine's statics, the array
ones (``None`` for absent optional ones) go to the engine as they are. The primal call builds
no residuals; the custom-VJP forward also keeps the chunk-start states for the backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from ejkernel_xla.ops._chunked import (
    Gates,
    LinearStatics,
    chunk_sizes,
    linear_attention_backward,
    linear_attention_forward,
)
from ejkernel_xla.ops._tuning import distinct

__all__ = ["SUB_CHUNKED_TUNING", "backward", "config_space", "forward", "heuristic", "primal"]

#: (chunk, sub-chunk) sizes the config spaces of the ops with sub-chunks offer.
SUB_CHUNKED_TUNING: tuple[tuple[int, int], ...] = (
    (32, 8),
    (32, 16),
    (64, 16),
    (64, 32),
    (128, 16),
    (128, 32),
)

#: The family's non-array arguments; ``layer_idx`` and ``num_layers`` (lightning attention's)
#: are already folded into its ``slopes`` by the core spec.
_STATICS = frozenset({"softmax_scale", "reverse", "return_state", "layer_idx", "num_layers"})


def _run(args: dict[str, Any], cfg: Any, gates: Gates, residuals: bool) -> tuple[Any, Any]:
    """The engine's forward for a call's keyword arguments."""
    arrays = {n: v for n, v in args.items() if n not in _STATICS}
    st = LinearStatics.of(
        arrays,
        cfg,
        softmax_scale=args.get("softmax_scale"),
        reverse=args.get("reverse", False),
        return_state=args.get("return_state", False),
    )
    return linear_attention_forward(arrays, st, gates, residuals=residuals)


def primal(args: dict[str, Any], cfg: Any, gates: Gates) -> Any:
    """The op's output, ``out`` or ``(out, final_state)``, with no residual work."""
    return _run(args, cfg, gates, residuals=False)[0]


def forward(*, gates: Gates, cfg: Any = None, **args: Any) -> tuple[Any, dict[str, Any]]:
    """The custom-VJP forward (``gates`` bound by the op): ``(out, residuals)``, the
    residuals being the arrays and the chunk-start states."""
    return _run(args, cfg, gates, residuals=True)


def backward(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    gates: Gates,
    cfg: Any = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    return_state: bool = False,
    **unused: Any,
) -> dict[str, Any]:
    """The custom-VJP backward (``gates`` bound by the op): a gradient per array argument."""
    del unused  # lightning attention's layer_idx and num_layers
    st = LinearStatics.of(
        residuals["arrays"],
        cfg,
        softmax_scale=softmax_scale,
        reverse=reverse,
        return_state=return_state,
    )
    return linear_attention_backward(residuals, d_out, st, gates)


@attrs.frozen
class _Sizes:
    """Requested sizes, read by :func:`chunk_sizes` like a config (``None``: the default)."""

    chunk_size: int | None = None
    sub_chunk_size: int | None = None


def _sized(config: type[Any], kwargs: Any, sizes: _Sizes) -> Any:
    """A ``config`` with the call's clamped sizes (:func:`chunk_sizes`), for the fields the
    class has (``chunk_size``, and ``sub_chunk_size`` where the op has sub-chunks)."""
    chunk, sub = chunk_sizes(kwargs, sizes)
    fitted = {"chunk_size": chunk, "sub_chunk_size": sub}
    return config(**{f.name: fitted[f.name] for f in attrs.fields(config)})


def heuristic(inv: Any, config: type[Any]) -> Any:
    """The backend's default sizes, smaller for short (packed) sequences."""
    return _sized(config, inv.kwargs, _Sizes())


def config_space(
    inv: Any, config: type[Any], tuning: Iterable[tuple[int, int | None]]
) -> list[Any]:
    """The heuristic's config, then the ``(chunk, sub_chunk)`` sizes of ``tuning`` clamped
    (``None``: the default), each once."""
    clamped = (_sized(config, inv.kwargs, _Sizes(*sizes)) for sizes in tuning)
    return distinct([heuristic(inv, config), *clamped])
