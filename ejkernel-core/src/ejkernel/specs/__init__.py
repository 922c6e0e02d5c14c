"""Op specs: each op's signature, validation and plain-JAX reference (one module per op).

Every public module here (no leading underscore) holds one op: ``SPEC``, ``<op>_reference``
and the public function ``<op>``. The registry finds them by listing this folder, so adding an
op is adding its module.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from ejkernel.specs._base import Arg, OpSpec

__all__ = ["Arg", "OpSpec", "builtin_ops", "builtin_spec"]


@functools.cache
def builtin_ops() -> tuple[str, ...]:
    """Names of the ops whose specs ship with core (the modules of this package)."""
    return tuple(
        sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    )


def builtin_spec(name: str) -> OpSpec:
    spec: OpSpec = importlib.import_module(f"ejkernel.specs.{name}").SPEC
    return spec
