"""Conformance examples of ``scaled_dot_product_attention``: flash attention's, without
dropout and sinks."""

from __future__ import annotations

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases.flash_attention import attention_examples, invalid_attention

__all__ = ["examples"]


def examples() -> list[Example | Invalid]:
    return [*attention_examples(dropout=False, sinks=False), *invalid_attention()]
