"""The flash-attention call the core tests record, stamp and differentiate, and its shape."""

from __future__ import annotations

from typing import Any

import jax

import ejkernel
from ejkernel.testing import AttentionShape

#: Odd lengths, GQA: the shape of the core tests' flash-attention calls.
SHAPE = AttentionShape(b=1, sq=37, sk=37, hq=4, hkv=2, d=16)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> jax.Array:
    """``ejkernel.flash_attention(q, k, v, causal=True, **kw)``."""
    return ejkernel.flash_attention(q, k, v, causal=True, **kw)
