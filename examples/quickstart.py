"""Quick start: flash attention through the executor, printing what was chosen and why."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import ejkernel
from ejkernel.modules import FlashAttention, create_default_executor


def main() -> None:
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (2, 512, 8, 64), jnp.float32)  # [B, Sq, Hq, D]
    k = jax.random.normal(kk, (2, 512, 2, 64), jnp.float32)  # GQA: 2 key/value heads
    v = jax.random.normal(kv, (2, 512, 2, 64), jnp.float32)

    print(f"ejkernel {ejkernel.__version__} on {jax.default_backend()}, jax {jax.__version__}")
    print("\nbefore the first call:")
    print(ejkernel.explain("flash_attention", q, k, v, causal=True))

    out = ejkernel.flash_attention(q, k, v, causal=True)
    print(f"\nout {out.shape} {out.dtype}; after the first call:")
    print(ejkernel.explain("flash_attention", q, k, v, causal=True))

    loss = jax.jit(jax.grad(lambda q: ejkernel.flash_attention(q, k, v, causal=True).sum()))
    print(f"\ngrad norm {float(jnp.linalg.norm(loss(q))):.4f}; the differentiated call:")
    print(ejkernel.explain("flash_attention", q, k, v, causal=True, grad=True))

    executor = create_default_executor()
    out2 = executor(FlashAttention(), q, k, v, causal=True, dropout_prob=0.1, logits_soft_cap=30.0)
    print(f"\nseed-style executor call: {out2.shape}, finite={bool(jnp.all(jnp.isfinite(out2)))}")
    ref = ejkernel.specs.flash_attention.flash_attention_reference(q, k, v, causal=True)
    print(f"max |out - reference| = {float(jnp.max(jnp.abs(out - ref))):.2e}")


if __name__ == "__main__":
    main()
