"""The conformance check of a flash-attention implementation's (out, lse) ring step
(:func:`ejkernel.plugins.deflse`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import EMPTY_ROW_LSE
from ejkernel.testing._helpers import assert_close, random_normal

__all__ = ["check_lse_step"]


def check_lse_step(platform: str, cfg: Any = None, *, batch: int = 1, seed: int = 7) -> None:
    """Check ``platform``'s (out, lse) step against the XLA step and the reference.

    A query shard (37 rows, GQA 4:2, head dim 16, rows 30 on of batch 0 padding) attends to two
    key shards the way a ring's last two steps do under a bottom-right causal mask: all of the
    first, the second causally. Each step's ``out`` and ``lse`` (natural log, ``[B, Sq, Hq]``,
    ``EMPTY_ROW_LSE`` on rows that see nothing) must match the XLA step's; merged by hand as
    the ring merges them, they must give the reference's output, and each step's backward,
    given the *merged* statistics, the reference's gradients (dQ summed, dK/dV per shard).

    Args:
        platform: the platform whose ``flash_attention`` offers the step.
        cfg: its config for both passes (``None``: its heuristic's).
        batch: batch size.
        seed: the inputs' key.

    The XLA step and the reference run at float32 matmul precision ``highest`` (a GPU's
    default is TF32, a thousandth off).
    """
    with jax.default_matmul_precision("highest"):
        _check_lse_step(platform, cfg, batch=batch, seed=seed)


def _check_lse_step(platform: str, cfg: Any, *, batch: int, seed: int) -> None:
    from ejkernel.plugins import flash_attention_lse_step
    from ejkernel.specs.flash_attention import flash_attention_reference

    b, s, hq, hkv, d = batch, 37, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = random_normal(ks[0], (b, s, hq, d))
    k, v = random_normal(ks[1], (b, 2 * s, hkv, d)), random_normal(ks[2], (b, 2 * s, hkv, d))
    seg = jnp.zeros((b, s), jnp.int32).at[0, 30:].set(-1)  # rows seeing no key
    kv_seg = jnp.zeros((b, 2 * s), jnp.int32)
    halves = [
        {"key": k[:, :s], "value": v[:, :s], "kv_segment_ids": kv_seg[:, :s], "causal": False},
        {"key": k[:, s:], "value": v[:, s:], "kv_segment_ids": kv_seg[:, s:], "causal": True},
    ]
    common = {"query": q, "q_segment_ids": seg}
    parts = []
    for half in halves:
        args = {**common, **half}
        step = flash_attention_lse_step(**args, platform=platform, cfg=cfg)
        assert step.platform == platform, f"{platform} offers no (out, lse) step: {step}"
        out, lse = step.forward(**args)
        ref_out, ref_lse = flash_attention_lse_step(**args, platform="xla").forward(**args)
        assert lse.shape == (b, s, hq) and lse.dtype == jnp.float32, (lse.shape, lse.dtype)
        assert_close(out, ref_out, name="out")
        assert_close(lse, ref_lse, name="lse")
        assert bool(jnp.all(lse[0, 30:] == EMPTY_ROW_LSE)), "an empty row's lse"
        parts.append((step, args, out, lse))
    lses = jnp.stack([jnp.where(p[3] >= EMPTY_ROW_LSE, -jnp.inf, p[3]) for p in parts])
    lse = jax.nn.logsumexp(lses, axis=0)
    weights = jnp.exp(lses - jnp.where(jnp.isneginf(lse), 0.0, lse))
    out = sum(w[..., None] * p[2] for w, p in zip(weights, parts, strict=True))
    lse = jnp.where(jnp.isneginf(lse), EMPTY_ROW_LSE, lse)
    d_out = random_normal(ks[3], out.shape)
    full = {**common, "key": k, "value": v, "kv_segment_ids": kv_seg, "causal": True}

    def reference(q: Any, k: Any, v: Any) -> Any:
        return flash_attention_reference(**{**full, "query": q, "key": k, "value": v})

    ref_out, vjp = jax.vjp(reference, q, k, v)
    assert_close(out, ref_out, name="merged out")
    dq, dk, dv = vjp(d_out)
    grads = [p[0].backward(out, lse, d_out, **p[1]) for p in parts]
    assert_close(grads[0]["query"] + grads[1]["query"], dq, name="dquery")
    assert_close(jnp.concatenate([g["key"] for g in grads], axis=1), dk, name="dkey")
    assert_close(jnp.concatenate([g["value"] for g in grads], axis=1), dv, name="dvalue")
