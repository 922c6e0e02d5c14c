"""Abstract flash-attention keywords for the CUDA plugin's ``supports()`` tests."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def sds(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def attention_kw(
    b: int = 2, sq: int = 64, sk: int = 64, hq: int = 8, hkv: int = 2, d: int = 128, **extra: Any
) -> dict[str, Any]:
    """The validated keywords of a flash-attention call, its arrays abstract (``dtype``, or
    ``q_dtype``/``k_dtype``/``v_dtype`` each; ``dv``), not causal, no window; ``extra``
    overrides."""
    dtype = extra.pop("dtype", jnp.bfloat16)
    base = {
        "query": sds((b, sq, hq, d), extra.pop("q_dtype", dtype)),
        "key": sds((b, sk, hkv, d), extra.pop("k_dtype", dtype)),
        "value": sds((b, sk, hkv, extra.pop("dv", d)), extra.pop("v_dtype", dtype)),
        "causal": False,
        "sliding_window": None,
    }
    return {**base, **extra}
