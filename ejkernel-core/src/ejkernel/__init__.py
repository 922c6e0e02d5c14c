"""ejkernel: the fastest correct way to run attention and friends from JAX, on any machine.

``ejkernel.<op>(...)`` picks the best installed implementation (plugins: ejkernel-xla,
ejkernel-triton, ...), chooses its config through the cache chain, and runs it under
``jit``/``grad``/``vmap``. ``ejkernel.explain(op, ...)`` says what it would pick and why.

Importing this package loads no backend: plugins are discovered on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ejkernel.specs.flash_attention import flash_attention
from ejkernel.specs.scaled_dot_product_attention import scaled_dot_product_attention

__version__ = "1.0.0"

__all__ = [
    "__version__",
    "explain",
    "flash_attention",
    "scaled_dot_product_attention",
]

_LAZY_MODULES = (
    "attention_semantics",
    "errors",
    "hookspecs",
    "kernels",
    "modules",
    "ops",
    "plugins",
    "specs",
    "testing",
)


def explain(op: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``ejkernel.<op>(*args, **kwargs)`` would run, and why, without running it.

    Returns a selection record with ``.platform``, ``.config``, ``.source`` (``override``,
    ``overlay``, ``memory``, ``persistent``, ``autotune`` or ``heuristic``) and ``.rejected``
    (implementation -> reason). ``grad=True`` explains the differentiated call.
    """
    from ejkernel._executor import explain as _explain

    return _explain(op, *args, **kwargs)


def __getattr__(name: str) -> Any:
    """Submodules and every op of the catalogue (``ejkernel.<op>``), imported on first use."""
    if name in _LAZY_MODULES:
        return importlib.import_module(f"ejkernel.{name}")
    from ejkernel.specs import builtin_ops

    if name in builtin_ops():
        return getattr(importlib.import_module(f"ejkernel.specs.{name}"), name)
    raise AttributeError(f"module 'ejkernel' has no attribute {name!r}")


def __dir__() -> list[str]:
    from ejkernel.specs import builtin_ops

    return sorted({*globals(), *_LAZY_MODULES, *builtin_ops()})
