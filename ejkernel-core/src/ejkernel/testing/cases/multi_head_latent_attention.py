"""Conformance examples of ``multi_head_latent_attention``: latent ranks and rope widths that
are not powers of two, causal, window and soft cap."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.testing._examples import FLOAT, Example, Invalid

__all__ = ["examples"]


def _scaled_weights(values: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Up-projections scaled by R ** -0.5, so keys and values stay of unit size."""
    del rng
    r = values["key_value"].shape[-1]
    return {name: np.asarray(values[name], np.float32) * r**-0.5 for name in ("w_kc", "w_vc")}


def _example(
    b: int, sq: int, sk: int, hq: int, r: int, dn: int, dr: int, dv: int, tags: str, **options: Any
) -> Example:
    return Example(
        name=f"B{b}-Sq{sq}-Sk{sk}-Hq{hq}-R{r}-Dn{dn}-Dr{dr}-Dv{dv}-{tags}",
        arrays={
            "query": ((b, sq, hq, dn + dr), FLOAT),
            "key_value": ((b, sk, r), FLOAT),
            "w_kc": ((r, hq, dn), FLOAT),
            "w_vc": ((r, hq, dv), FLOAT),
            "k_rope": ((b, sk, dr), FLOAT),
        },
        options=options,
        fill=_scaled_weights,
    )


def examples() -> list[Example | Invalid]:
    return [
        _example(2, 37, 37, 4, 48, 32, 16, 24, "causal", causal=True),
        _example(
            1,
            5,
            129,
            3,
            40,
            24,
            8,
            40,
            "window-softcap",
            sliding_window=(32, 0),
            logits_soft_cap=10.0,
        ),
        Invalid.extra_axis("query"),
        Invalid.replace("w_kc-rank-differs", w_kc=lambda a: a["w_kc"][1:]),
    ]
