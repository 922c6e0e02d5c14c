"""mean_pooling on XLA: a float32 sum per sequence divided by its length; O(T·D) both ways.

- Dense ``x [B, S, D]``: a float32 sum over S, divided by S. Backward: ``d_out / S``
  broadcast over the S tokens.
- Packed ``x [T, D]`` / ``[1, T, D]`` with ``cu_seqlens [N + 1]``: each token's sequence is
  ``searchsorted(ends, t, side="right")`` (non-decreasing in t, so a sorted segment sum);
  tokens outside ``[cu_seqlens[0], cu_seqlens[N])`` are zeroed before the sum rather than
  sent to an extra segment, which keeps the ids sorted and in range. The sums are a
  ``segment_sum`` (one scatter-add pass, exact float32 accumulation; a prefix-sum difference
  would cost the same but cancel badly on long packs), divided by ``max(length, 1)`` so an
  empty sequence is 0, never NaN. Backward: token t receives ``d_out[seq(t)] / length`` (a
  gather), zero outside every sequence.

There is nothing to tune (no config). It declines nothing (no ``supports``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp

__all__ = ["mean_pooling_xla"]


def mean_pooling_xla(
    *, x: jax.Array, cu_seqlens: jax.Array | None = None, cfg: Any = None
) -> jax.Array:
    """Mean over each sequence's tokens: the op's arguments
    (:func:`ejkernel.specs.mean_pooling.mean_pooling`, validated by the core); ``cfg`` is
    unused (nothing to tune).

    Returns:
        [B, D] or [N, D] in the dtype of ``x``; empty sequences give zero rows.
    """
    del cfg
    if cu_seqlens is None and x.ndim == 3:
        return _dense_mean(x)
    return _packed_mean(x, _offsets(x, cu_seqlens))


def _mean_pooling_fwd(**args: Any) -> tuple[jax.Array, dict[str, jax.Array | None]]:
    """Forward of :func:`mean_pooling_xla`: ``(out, residuals)``; residuals are the inputs."""
    return mean_pooling_xla(**args), {"x": args["x"], "cu_seqlens": args.get("cu_seqlens")}


def _mean_pooling_bwd(
    residuals: dict[str, jax.Array | None], d_out: jax.Array, *, cfg: Any = None
) -> dict[str, jax.Array]:
    """Backward of :func:`mean_pooling_xla`: ``{"x": d_x}`` in the dtype of ``x``."""
    del cfg
    x, cu_seqlens = residuals["x"], residuals["cu_seqlens"]
    assert x is not None
    if cu_seqlens is None and x.ndim == 3:
        return {"x": _dense_mean_bwd(x, d_out)}
    return {"x": _packed_mean_bwd(x, _offsets(x, cu_seqlens), d_out)}


defvjp(mean_pooling_xla, _mean_pooling_fwd, _mean_pooling_bwd)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _offsets(x: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    """[N + 1] int32 offsets clipped to [0, T] (``[0, T]`` for one unpacked sequence)."""
    num_tokens = x.shape[-2]
    if cu_seqlens is None:
        return jnp.asarray([0, num_tokens], jnp.int32)
    return jnp.clip(cu_seqlens.astype(jnp.int32), 0, num_tokens)


@jax.jit
def _dense_mean(x: jax.Array) -> jax.Array:
    total = jnp.sum(x, axis=1, dtype=jnp.float32)
    return (total / max(x.shape[1], 1)).astype(x.dtype)


@jax.jit
def _dense_mean_bwd(x: jax.Array, d_out: jax.Array) -> jax.Array:
    share = d_out.astype(jnp.float32) / max(x.shape[1], 1)
    return jnp.broadcast_to(share[:, None, :], x.shape).astype(x.dtype)


def _token_sequences(offsets: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sequence of each token [T] (sorted, in [0, N)), whether it is inside one [T], and the
    sequence lengths [N] (float32, at least 1 so empty sequences divide to 0)."""
    num_seqs = offsets.shape[0] - 1
    position = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(offsets[1:], position, side="right")
    inside = (position >= offsets[0]) & (position < offsets[-1])
    lengths = jnp.maximum(offsets[1:] - offsets[:-1], 1).astype(jnp.float32)
    return jnp.minimum(seq, num_seqs - 1), inside, lengths


@jax.jit
def _packed_mean(x: jax.Array, offsets: jax.Array) -> jax.Array:
    tokens = x.reshape(-1, x.shape[-1])
    seq, inside, lengths = _token_sequences(offsets, tokens.shape[0])
    tokens = jnp.where(inside[:, None], tokens.astype(jnp.float32), 0.0)
    sums = jax.ops.segment_sum(
        tokens, seq, num_segments=offsets.shape[0] - 1, indices_are_sorted=True
    )
    return (sums / lengths[:, None]).astype(x.dtype)


@jax.jit
def _packed_mean_bwd(x: jax.Array, offsets: jax.Array, d_out: jax.Array) -> jax.Array:
    seq, inside, lengths = _token_sequences(offsets, x.shape[-2])
    share = d_out.astype(jnp.float32) / lengths[:, None]  # [N, D]
    d_tokens = jnp.where(inside[:, None], share[seq], 0.0)
    return d_tokens.reshape(x.shape).astype(x.dtype)
