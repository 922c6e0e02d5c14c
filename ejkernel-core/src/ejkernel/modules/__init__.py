"""Every op as a function and as a kernel class, with its op-level config (the seeds' API).

For each op ``x_y`` of the catalogue: the function ``x_y``, the kernel class ``XY`` (run it with
an executor) and the op-level config ``XYConfig`` (``fwd_params``, ``bwd_params``,
``chunk_size``, ``options`` (any other tunable by name, e.g. ``{"block_m": 64}``) and
``platform``; converted field by field to the selected implementation's config).
Flash attention's are written out below; the others are made on first access.

Example:
    >>> from ejkernel.modules import FlashAttention, create_default_executor
    >>> executor = create_default_executor()
    >>> out = executor(FlashAttention(), q, k, v, causal=True)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import attrs

from ejkernel._cache import ConfigCache, PersistentCache
from ejkernel._chain import ConfigSelectorChain
from ejkernel._executor import Executor
from ejkernel._kernel import OpKernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs import builtin_ops, builtin_spec
from ejkernel.specs import flash_attention as _fa
from ejkernel.specs import scaled_dot_product_attention as _sdpa
from ejkernel.specs.flash_attention import flash_attention
from ejkernel.specs.scaled_dot_product_attention import scaled_dot_product_attention

__all__ = [
    "BwdParams",
    "FlashAttention",
    "FlashAttentionConfig",
    "FwdParams",
    "ScaledDotProductAttention",
    "ScaledDotProductAttentionConfig",
    "create_default_executor",
    "flash_attention",
    "scaled_dot_product_attention",
]


@attrs.frozen(kw_only=True)
class FlashAttentionConfig:
    """Op-level config of flash attention, valid on every platform.

    Passed as ``cfg=``, it is converted to the selected implementation's config (fields by
    name); a ``platform`` other than ``None``/``"auto"`` also selects the platform.

    Attributes:
        fwd_params: forward block sizes, warps, stages.
        bwd_params: backward block sizes, warps, stages.
        platform: ``"xla"``, ``"triton"``, ... or ``None`` / ``"auto"``.
    """

    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None
    platform: str | None = None


@attrs.frozen(kw_only=True)
class ScaledDotProductAttentionConfig:
    """Op-level config of scaled dot-product attention (as :class:`FlashAttentionConfig`)."""

    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None
    platform: str | None = None


class FlashAttention(OpKernel[FlashAttentionConfig, object]):
    """Flash attention as a kernel: ``executor(FlashAttention(), q, k, v, causal=True)``."""

    spec = _fa.SPEC


class ScaledDotProductAttention(OpKernel[ScaledDotProductAttentionConfig, object]):
    """Scaled dot-product attention as a kernel."""

    spec = _sdpa.SPEC


def create_default_executor(*, autotune: bool = True, persistent: bool = True) -> Executor:
    """A new executor with its own memory cache, the default persistent cache and autotuning.

    Args:
        autotune: allow autotuning (still subject to ``EJKERNEL_AUTOTUNE_POLICY``).
        persistent: use the persistent cache (``EJKERNEL_CACHE_DIR``).
    """
    return Executor(
        ConfigSelectorChain(
            cache=ConfigCache(),
            persistent=PersistentCache() if persistent else False,
            autotune=autotune,
        )
    )


def _camel(op: str) -> str:
    return "".join(part.capitalize() for part in op.split("_"))


@functools.cache
def _op_names() -> dict[str, tuple[str, str]]:
    """Public name -> (op, what): ``XY`` -> kernel, ``XYConfig`` -> config, ``x_y`` -> function."""
    names: dict[str, tuple[str, str]] = {}
    for op in builtin_ops():
        names[op] = (op, "function")
        names[_camel(op)] = (op, "kernel")
        names[f"{_camel(op)}Config"] = (op, "config")
    return names


@functools.cache
def _make(op: str, what: str) -> Any:
    if what == "function":
        return getattr(importlib.import_module(f"ejkernel.specs.{op}"), op)
    if what == "kernel":
        return type(
            _camel(op),
            (OpKernel,),
            {"spec": builtin_spec(op), "__module__": __name__, "__doc__": f"{op} as a kernel."},
        )
    return attrs.make_class(
        f"{_camel(op)}Config",
        {
            "fwd_params": attrs.field(default=None),
            "bwd_params": attrs.field(default=None),
            "chunk_size": attrs.field(default=None),
            "options": attrs.field(default=None),
            "platform": attrs.field(default=None),
        },
        frozen=True,
        kw_only=True,
    )


def __getattr__(name: str) -> Any:
    entry = _op_names().get(name)
    if entry is None:
        raise AttributeError(f"module 'ejkernel.modules' has no attribute {name!r}")
    return _make(*entry)


def __dir__() -> list[str]:
    return sorted({*globals(), *_op_names()})
