"""A toy flash-attention implementation (the reference with a tunable config) for core tests."""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel.plugins import defvjp, hookimpl
from ejkernel.specs.flash_attention import flash_attention_reference

CALLS: list[Any] = []


@attrs.frozen(kw_only=True)
class ToyConfig:
    block: int = 64


def heuristic(inv: Any) -> ToyConfig:
    return ToyConfig(block=32 if inv.kwargs["query"].shape[1] < 64 else 64)


def config_space(inv: Any) -> list[ToyConfig]:
    return [ToyConfig(block=16), ToyConfig(block=32), ToyConfig(block=64)]


def supports(inv: Any) -> bool | str:
    if inv.kwargs.get("dropout_prob", 0.0) > 0:
        return "toy does not do dropout"
    return True


def flash_attention_toy(*, cfg: ToyConfig, **kw: Any) -> jax.Array:
    CALLS.append(("run", cfg))
    return flash_attention_reference(**kw)


def _fwd(*, cfg: ToyConfig, **kw: Any) -> tuple[jax.Array, Any]:
    CALLS.append(("fwd", cfg))
    arrays = {k: v for k, v in kw.items() if v is not None and hasattr(v, "shape")}
    return flash_attention_reference(**kw), arrays


def _bwd(
    arrays: dict[str, Any], d_out: jax.Array, *, cfg: ToyConfig, **statics: Any
) -> dict[str, Any]:
    CALLS.append(("bwd", cfg))
    diff = {
        k: v for k, v in arrays.items() if k in ("query", "key", "value", "bias", "softmax_aux")
    }
    rest = {k: v for k, v in arrays.items() if k not in diff}
    _, vjp = jax.vjp(lambda d: flash_attention_reference(**d, **rest, **statics), diff)
    return vjp(d_out)[0]


defvjp(flash_attention_toy, _fwd, _bwd)


@hookimpl
def ejkernel_api_version() -> int:
    return 1


def register_flash_attention(
    registry: Any, impl: Any, *, platform: str, priority: int, **hooks: Any
) -> None:
    """Register ``impl`` as flash attention on ``platform`` with the toy's config and
    heuristic; ``hooks`` are the further registration callables (``config_space``,
    ``supports``)."""
    registry.register(
        "flash_attention",
        platform=platform,
        backend="any",
        priority=priority,
        config=ToyConfig,
        heuristic=heuristic,
        **hooks,
    )(impl)


@hookimpl
def ejkernel_register(registry: Any) -> None:
    register_flash_attention(
        registry,
        flash_attention_toy,
        platform="toy",
        priority=50,
        config_space=config_space,
        supports=supports,
    )
