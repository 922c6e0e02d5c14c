"""Conformance examples of ``ring_attention`` without ``axis_name`` (flash attention's
semantics; the ring itself needs several devices and is tested in the backend's tests)."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases.flash_attention import attention_examples, invalid_attention

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [*attention_examples(dropout=True, sinks=True), *invalid_attention()]
