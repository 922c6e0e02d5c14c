"""Op specs: each op's signature, validation and plain-JAX reference (one module per op)."""

from __future__ import annotations

import importlib

from ejkernel.specs._base import Arg, OpSpec

__all__ = ["BUILTIN_OPS", "Arg", "OpSpec", "builtin_spec"]

#: op name -> module under ejkernel.specs holding ``SPEC``.
BUILTIN_OPS: tuple[str, ...] = ("flash_attention", "scaled_dot_product_attention")


def builtin_spec(name: str) -> OpSpec:
    spec: OpSpec = importlib.import_module(f"ejkernel.specs.{name}").SPEC
    return spec
