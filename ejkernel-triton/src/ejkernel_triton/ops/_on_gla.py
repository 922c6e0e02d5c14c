"""What the ops that run on the gla kernels (recurrent, lightning_attention) share: gla's
argument dict for a key gate, gla's limits, and the config a call runs with (gla's own too)."""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel_triton.ops.gla_config import GlaConfig, heuristic, kernel_limits

#: The arguments such an op passes through to gla unchanged (the key gate ``g`` is its own).
GLA_ARGS = (
    "query",
    "key",
    "value",
    "initial_state",
    "cu_seqlens",
    "softmax_scale",
    "return_state",
)


@attrs.frozen
class Inv:
    """An invocation's keyword arguments, as gla's ``supports`` and ``heuristic`` read them."""

    kwargs: dict[str, Any]


def gla_args(args: dict[str, Any], gate: jax.Array) -> dict[str, Any]:
    """gla's arguments for the call: the pass-through ones of ``args`` and the key ``gate``."""
    return {**{n: args.get(n) for n in GLA_ARGS}, "g": gate}


def gla_supports(args: dict[str, Any], gates: tuple[str, ...] = ()) -> bool | str:
    """gla's limits (dtypes, K and V ≤ 256) on the call's ``gates`` (those given) and its
    query, key and value."""
    return kernel_limits(args, (*gates, "query", "key", "value"))


def config(cfg: GlaConfig | None, args: dict[str, Any]) -> GlaConfig:
    """``cfg``, or gla's heuristic choice for the call when ``None``."""
    return heuristic(Inv(args)) if cfg is None else cfg
