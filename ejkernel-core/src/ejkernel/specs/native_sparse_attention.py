"""native_sparse_attention: NSA, three causal attention branches mixed by per-token gates.

"Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention" (Yuan et
al., DeepSeek, 2025), with the conventions of flash-linear-attention's ``parallel_nsa``. Exact
semantics every implementation follows (``bs = block_size``, ``G = Hq // Hkv``):

- Self-attention: ``key``/``value`` have the query's length S; everything is causal. Positions
  count from the start of each sequence: the batch row, or with ``cu_seqlens`` (B = 1) the packed
  sequence ``[cu_seqlens[j], cu_seqlens[j+1])``; nothing crosses a sequence boundary.
- Blocks: position p lies in block ``p // bs`` of its sequence.
- Compressed branch (paper Sec. 3.3.1). Every *complete* block c of a sequence becomes one
  compressed token: the mean of its ``bs`` keys and the mean of its ``bs`` values (φ = mean
  pooling, as fla; the paper's φ is a learned MLP over blocks that may overlap, which the caller
  can apply beforehand). A query at position t sees compressed token c only when the block lies
  wholly in its past, ``(c + 1)·bs - 1 ≤ t``; a trailing partial block never has one. The
  branch is softmax attention over the visible compressed tokens (zeros when there is none).
- Selection (Sec. 3.3.2). Without ``block_indices``, block c's importance for query t and KV
  head h is the mean over the G query heads of the group of their compressed-branch
  probabilities of token c (the paper's Eq. 10 sums them: the ranking is the same); the first
  block and the query's current and previous blocks (``0``, ``t // bs``, ``t // bs - 1``)
  score 1, above any probability, so they are always chosen; blocks neither visible nor forced
  are never chosen. The ``block_counts`` best blocks are kept (ties: the lower index), the
  remaining slots are -1. The selection is shared by the G query heads of a KV head and is not
  differentiated.
- Selected branch. Softmax attention over the union of the tokens of the selected blocks at
  positions ≤ t (so the current block is read up to the query). Given ``block_indices``
  ``[B, S, Hkv, T]`` are used as they are (T is free; ``block_counts`` is then unused): block
  indices of the query's sequence, negative ones empty slots, a repeated block counted once.
- Sliding-window branch (when ``window_size > 0`` and ``g_swa`` is given): softmax attention
  over the ``window_size`` positions ``[t - window_size + 1, t]`` of the sequence.
- Output: ``g_cmp ⊙ o_cmp + g_slc ⊙ o_slc (+ g_swa ⊙ o_swa)`` with gates ``[B, S, Hq]`` used as
  given (the paper's sigmoid is the caller's). Accumulation is float32; the output keeps the
  query dtype. Gradients flow to query, key, value and the gates.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.attention_semantics import finite_or_zero, masked_softmax
from ejkernel.specs._base import (
    builtin_op_spec,
    call_op,
    check_array,
    check_qkv,
    check_softmax_scale,
    is_floating,
    is_integer,
)
from ejkernel.specs.recurrent import check_packed_sequences

__all__ = [
    "SPEC",
    "native_sparse_attention",
    "native_sparse_attention_reference",
    "nsa_select_blocks",
    "sequence_layout",
    "validate_native_sparse_attention",
]

OP = "native_sparse_attention"


def sequence_layout(
    batch: int, seqlen: int, cu_seqlens: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: sequence id, index of its sequence's first token, position in its sequence.

    Returns three int32 arrays of shape [B|1, S]: with ``cu_seqlens`` token t belongs to the
    sequence j with ``cu_seqlens[j] ≤ t < cu_seqlens[j+1]``; without, each batch row is one
    sequence.
    """
    t = jnp.arange(seqlen, dtype=jnp.int32)
    if cu_seqlens is None:
        zeros = jnp.zeros((1, seqlen), jnp.int32)
        return zeros, zeros, t[None]
    cu = cu_seqlens.astype(jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, cu.shape[0] - 2)
    start = cu[seq]
    return seq[None], start[None], (t - start)[None]


def nsa_select_blocks(
    p_cmp: jax.Array, pos: jax.Array, *, block_size: int, block_counts: int, num_blocks: int
) -> jax.Array:
    """Top-``block_counts`` blocks per query and KV head from compressed probabilities.

    Args:
        p_cmp: [..., Sq, Hkv, G, NB] compressed-branch probabilities of block c of the query's
            own sequence (zero where the block is not visible).
        pos: [..., Sq] position of each query in its sequence.
        block_size: tokens per block.
        block_counts: blocks kept per query.
        num_blocks: NB, the number of block indices a sequence can have.

    Returns:
        [..., Sq, Hkv, block_counts] int32 block indices, -1 in unused slots.
    """
    c = jnp.arange(num_blocks, dtype=jnp.int32)
    pos = pos[..., None, None]  # [..., Sq, 1, 1]
    current = pos // block_size
    visible = (c + 1) * block_size - 1 <= pos
    forced = (c == 0) | (c == current) | (c == current - 1)
    score = jax.lax.stop_gradient(jnp.mean(p_cmp.astype(jnp.float32), axis=-2))
    score = jnp.where(forced, 1.0, jnp.where(visible, score, -1.0))
    count = min(block_counts, num_blocks)
    top, idx = jax.lax.top_k(score, count)
    idx = jnp.where(top >= 0.0, idx, -1).astype(jnp.int32)
    if count < block_counts:
        pad = [(0, 0)] * (idx.ndim - 1) + [(0, block_counts - count)]
        idx = jnp.pad(idx, pad, constant_values=-1)
    return idx


def native_sparse_attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g_cmp: jax.Array,
    g_slc: jax.Array,
    g_swa: jax.Array | None = None,
    *,
    block_size: int = 64,
    block_counts: int = 16,
    window_size: int = 0,
    block_indices: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
) -> jax.Array:
    """Dense float32 NSA: the oracle every implementation is tested against (small S only).

    Every branch is written as masked attention over all keys (or all blocks) of the batch row.
    """
    b, s, hq, d = query.shape
    hkv = key.shape[2]
    group, bs = hq // hkv, block_size
    num_blocks = -(-s // bs)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    q = query.astype(jnp.float32).reshape(b, s, hkv, group, d)
    # Non-finite keys/values read as 0: a hidden one contributes nothing (attention_semantics).
    k, v = finite_or_zero(key.astype(jnp.float32)), finite_or_zero(value.astype(jnp.float32))
    seq, start, pos = sequence_layout(b, s, cu_seqlens)  # [1, S] each

    # Compressed tokens as seen from query t: block c of t's sequence, tokens start_t + c·bs + u.
    c = jnp.arange(num_blocks)
    tokens = start[..., None, None] + c[:, None] * bs + jnp.arange(bs)  # [1, S, NB, bs]
    tokens = jnp.broadcast_to(jnp.clip(tokens, 0, s - 1), (b, *tokens.shape[1:]))
    rows = jnp.arange(b)[:, None, None, None]
    k_cmp = jnp.mean(k[rows, tokens], axis=3)  # [B, S, NB, Hkv, D]
    v_cmp = jnp.mean(v[rows, tokens], axis=3)
    cmp_visible = ((c + 1) * bs - 1 <= pos[..., None])[:, :, None, None, :]  # [1, S, 1, 1, NB]
    logits = jnp.einsum("bthgd,btchd->bthgc", q, k_cmp) * scale
    p_cmp = masked_softmax(logits, cmp_visible)
    o_cmp = jnp.einsum("bthgc,btchd->bthgd", p_cmp, v_cmp)

    if block_indices is None:
        block_indices = nsa_select_blocks(
            p_cmp, pos, block_size=bs, block_counts=block_counts, num_blocks=num_blocks
        )
    # Token j is selected for query t when its block (counted from t's sequence start) is listed.
    key_pos = jnp.arange(s)[None, None, :] - start[..., None]  # [1, S, S]: j's position for t
    same_seq = seq[:, :, None] == seq[:, None, :]
    causal = same_seq & (key_pos >= 0) & (key_pos <= pos[..., None])
    listed = (
        block_indices[..., :, None] == (key_pos // bs)[:, :, None, None, :]
    )  # [B, S, Hkv, T, S]
    selected = jnp.any(listed & (block_indices >= 0)[..., None], axis=3) & causal[:, :, None]
    logits = jnp.einsum("bthgd,bjhd->bthgj", q, k) * scale
    o_slc = jnp.einsum("bthgj,bjhd->bthgd", masked_softmax(logits, selected[:, :, :, None]), v)

    out = g_cmp.astype(jnp.float32)[..., None] * o_cmp.reshape(b, s, hq, o_cmp.shape[-1])
    out = out + g_slc.astype(jnp.float32)[..., None] * o_slc.reshape(b, s, hq, o_slc.shape[-1])
    if window_size > 0 and g_swa is not None:
        window = causal & (key_pos > pos[..., None] - window_size)
        o_swa = jnp.einsum("bthgj,bjhd->bthgd", masked_softmax(logits, window[:, :, None, None]), v)
        out = out + g_swa.astype(jnp.float32)[..., None] * o_swa.reshape(b, s, hq, o_swa.shape[-1])
    return out.astype(query.dtype)


def _int_static(name: str, x: Any, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{OP}: `{name}` must be an int (it is static); got {x!r}")
    if x < minimum:
        raise ValueError(f"{OP}: `{name}` must be >= {minimum}; got {x}")
    return int(x)


def validate_native_sparse_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of native sparse attention; fill defaults."""
    q, k, v = a["query"], a["key"], a["value"]
    check_qkv(OP, q, k, v, letters=("[B, S, Hq, D]", "[B, S, Hkv, D]", "[B, S, Hkv, Dv]"))
    b, s, hq, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d or k.shape[2] == 0 or hq % k.shape[2] != 0:
        raise ValueError(
            f"{OP}: `key` must be [B, S, Hkv, D] (the query's B, S and D) with Hq % Hkv == 0; "
            f"got key.shape={tuple(k.shape)}, query.shape={tuple(q.shape)}"
        )
    hkv = k.shape[2]
    if v.shape[:3] != (b, s, hkv) or v.shape[3] == 0:
        raise ValueError(
            f"{OP}: `value` must be [B, S, Hkv, Dv]; got value.shape={tuple(v.shape)}, "
            f"key.shape={tuple(k.shape)}"
        )
    if min(s, d) == 0:
        raise ValueError(
            f"{OP}: `query` must have non-empty S and D; got query.shape={tuple(q.shape)}"
        )
    for name in ("g_cmp", "g_slc", "g_swa"):
        g = a.get(name)
        if g is None:
            if name != "g_swa":
                raise TypeError(f"{OP}: `{name}` is required ([B, S, Hq] gate)")
            continue
        check_array(OP, name, g, ndim=3, letters="[B, S, Hq]")
        if tuple(g.shape) != (b, s, hq) or not is_floating(g):
            raise ValueError(
                f"{OP}: `{name}` must be a floating [B, S, Hq]={(b, s, hq)} gate; got "
                f"{name}.shape={tuple(g.shape)}, dtype {g.dtype}"
            )
    a["block_size"] = _int_static("block_size", a.get("block_size", 64), 1)
    a["block_counts"] = _int_static("block_counts", a.get("block_counts", 16), 1)
    a["window_size"] = _int_static("window_size", a.get("window_size", 0), 0)
    idx = a.get("block_indices")
    if idx is not None:
        check_array(OP, "block_indices", idx, ndim=4, letters="[B, S, Hkv, T]")
        if tuple(idx.shape[:3]) != (b, s, hkv) or idx.shape[3] == 0:
            raise ValueError(
                f"{OP}: `block_indices` must be [B, S, Hkv, T]={(b, s, hkv)} + (T,) with T >= 1; "
                f"got block_indices.shape={tuple(idx.shape)}"
            )
        if not is_integer(idx):
            raise TypeError(
                f"{OP}: `block_indices` must be an integer array; got dtype {idx.dtype}"
            )
    check_packed_sequences(OP, a.get("cu_seqlens"), q)
    a["softmax_scale"] = check_softmax_scale(OP, a.get("softmax_scale"), d)
    return a


def _synthetic(abstract: Any, seed: int = 0) -> dict[str, Any]:
    """Random tensors, block 0 as the given selection, and equal packed sequences."""
    from ejkernel.specs._base import default_synthetic, even_offsets

    out = default_synthetic(abstract, seed)
    cu = abstract.get("cu_seqlens")
    if isinstance(cu, jax.ShapeDtypeStruct):
        n, s = cu.shape[0] - 1, abstract["query"].shape[1]
        out["cu_seqlens"] = jnp.asarray(even_offsets(s, n), cu.dtype)
    return out


def native_sparse_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g_cmp: jax.Array,
    g_slc: jax.Array,
    g_swa: jax.Array | None = None,
    *,
    block_size: int = 64,
    block_counts: int = 16,
    window_size: int = 0,
    block_indices: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Native sparse attention (NSA): compressed, selected and sliding-window branches, gated.

    Args:
        query: [B, S, Hq, D].
        key: [B, S, Hkv, D], Hq % Hkv == 0 (GQA: selection shared by a KV head's queries).
        value: [B, S, Hkv, Dv].
        g_cmp: [B, S, Hq] gate of the compressed branch.
        g_slc: [B, S, Hq] gate of the selected branch.
        g_swa: [B, S, Hq] gate of the sliding-window branch; ``None`` skips that branch.
        block_size: tokens per block, for compression and selection alike (static).
        block_counts: blocks each query selects (static; unused with ``block_indices``).
        window_size: tokens of the sliding window, the query's own included; 0 skips it.
        block_indices: [B, S, Hkv, T] int, the blocks to attend (negative: empty slot);
            ``None`` selects them from the compressed attention scores.
        softmax_scale: multiplies the logits; default D ** -0.5.
        cu_seqlens: [num_seqs + 1] int offsets of packed sequences (B must be 1), from 0 to S.
        platform: force an installed platform.
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [B, S, Hq, Dv] in the query dtype.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    native_sparse_attention,
    differentiable=("query", "key", "value", "g_cmp", "g_slc", "g_swa"),
    synthetic=_synthetic,
)
