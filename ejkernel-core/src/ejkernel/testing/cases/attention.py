"""Conformance examples of ``attention`` (materialised; returns the probabilities too)."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases.flash_attention import attention_examples, invalid_attention

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [*attention_examples(dropout=True, sinks=True), *invalid_attention()]
