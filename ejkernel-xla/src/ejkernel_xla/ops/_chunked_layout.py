"""Chunk layout of the chunked linear-attention engine (:mod:`ejkernel_xla.ops._chunked`).

How tokens map to chunks ([B, S, H, F] <-> [N, B, H, C, F]), dense or with packed sequences
laid out chunk-aligned, and where each sequence's state starts and ends.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_xla.ops._chunk_numerics import floor_gates

if TYPE_CHECKING:
    from ejkernel_xla.ops._chunked import Gates, LinearStatics

__all__ = ["Plan", "layout", "pad_axis"]


@attrs.frozen(kw_only=True)
class Plan:
    """How tokens map to chunks, and where sequences start and end (integer arrays).

    Without ``cu_seqlens`` each batch row is one sequence of ``N = ceil(S / C)`` chunks. With
    it, the (single) row's sequences are laid out chunk-aligned: sequence m owns chunks
    ``[chunk_off[m], chunk_off[m + 1])``; chunks past the last sequence are padding.

    Attributes:
        seq: S.
        chunk: C.
        num_chunks: N (static).
        reverse: tokens are flipped before the layout.
        slot_token / slot_valid: [N·C] source token of each slot (packed layout only).
        token_slot / token_valid: [S] slot of each token (packed layout only).
        sid: [N] sequence (state row) of each chunk; padding chunks use the last, zero row.
        reset: [N] the chunk starts its sequence (the state is reset to its initial state).
        last: [N] the chunk ends its sequence (its end state is the final state).
        first_chunk / nonempty: [R] first chunk of each sequence, and whether it has one.
        last_chunk: [R] last chunk of each sequence.
    """

    seq: int
    chunk: int
    num_chunks: int
    reverse: bool
    packed: bool
    slot_token: Any = None
    slot_valid: Any = None
    token_slot: Any = None
    token_valid: Any = None
    sid: Any = None
    reset: Any = None
    last: Any = None
    first_chunk: Any = None
    last_chunk: Any = None
    nonempty: Any = None

    @classmethod
    def of(cls, a: dict[str, Any], st: LinearStatics) -> Plan:
        s, c = a["query"].shape[1], st.chunk
        plan = functools.partial(cls, seq=s, chunk=c, reverse=st.reverse)  # both layouts' fields
        cu = a.get("cu_seqlens")
        if cu is None:
            n = -(-s // c)
            idx = jnp.arange(n)
            return plan(
                num_chunks=n,
                packed=False,
                sid=jnp.zeros(n, jnp.int32),
                reset=idx == 0,
                last=idx == n - 1,
                first_chunk=jnp.zeros(1, jnp.int32),
                last_chunk=jnp.full(1, n - 1, jnp.int32),
                nonempty=jnp.ones(1, bool),
            )
        cu = cu.astype(jnp.int32)
        if st.reverse:
            cu = s - cu[::-1]
        m = cu.shape[0] - 1
        n = max(1, (s + m * (c - 1)) // c)
        lens = jnp.maximum(cu[1:] - cu[:-1], 0)
        counts = (lens + c - 1) // c
        off = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
        chunk_idx = jnp.arange(n, dtype=jnp.int32)
        sid = jnp.searchsorted(off[1:], chunk_idx, side="right").astype(jnp.int32)  # m = padding
        real = chunk_idx < off[m]
        sid_c = jnp.minimum(sid, m - 1)
        reset = ~real | (chunk_idx == off[sid_c])
        last = ~real | (chunk_idx == off[sid_c + 1] - 1)
        slot = jnp.arange(n * c, dtype=jnp.int32)
        slot_chunk = slot // c
        slot_sid = sid_c[slot_chunk]
        offset = (slot_chunk - off[slot_sid]) * c + slot % c
        slot_valid = real[slot_chunk] & (offset < lens[slot_sid])
        slot_token = jnp.clip(cu[slot_sid] + offset, 0, s - 1)
        tok = jnp.arange(s, dtype=jnp.int32)
        tok_sid = jnp.searchsorted(cu[1:], tok, side="right").astype(jnp.int32)
        token_valid = (tok >= cu[0]) & (tok_sid < m)
        tok_sid = jnp.minimum(tok_sid, m - 1)
        token_slot = jnp.clip(off[tok_sid] * c + tok - cu[tok_sid], 0, n * c - 1)
        return plan(
            num_chunks=n,
            packed=True,
            slot_token=slot_token,
            slot_valid=slot_valid,
            token_slot=token_slot,
            token_valid=token_valid,
            sid=jnp.where(real, sid_c, m),
            reset=reset,
            last=last,
            first_chunk=jnp.minimum(off[:-1], n - 1),
            last_chunk=jnp.clip(off[1:] - 1, 0, n - 1),
            nonempty=counts > 0,
        )

    def to_chunks(self, x: jax.Array) -> jax.Array:
        """[B, S, H, F] -> [N, B, H, C, F], padded with zeros (identity tokens)."""
        if self.reverse:
            x = x[:, ::-1]
        b, _, h, f = x.shape
        if not self.packed:
            x = pad_axis(x, 1, self.num_chunks * self.chunk)
            return x.reshape(b, self.num_chunks, self.chunk, h, f).transpose(1, 0, 3, 2, 4)
        x = jnp.take(x[0], self.slot_token, axis=0)
        x = jnp.where(self.slot_valid[:, None, None], x, 0.0)
        return x.reshape(self.num_chunks, 1, self.chunk, h, f).transpose(0, 1, 3, 2, 4)

    def from_chunks(self, x: jax.Array) -> jax.Array:
        """[N, B, H, C, F] -> [B, S, H, F]; tokens outside every sequence are zero."""
        n, b, h, c, f = x.shape
        x = x.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, f)
        if not self.packed:
            x = x[:, : self.seq]
        else:
            x = jnp.take(x[0], self.token_slot, axis=0)
            x = jnp.where(self.token_valid[:, None, None], x, 0.0)[None]
        return x[:, ::-1] if self.reverse else x

    def state_rows(self, init: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
        """[N, H, K, V] initial states -> [B, R + 1, H, K, V] rows (R sequences per batch row,
        then a zero row for padding chunks)."""
        b = shape[0]
        rows = 1 if not self.packed else self.first_chunk.shape[0]
        per_row = (b, rows, *shape[1:])
        x = jnp.zeros(per_row, jnp.float32) if init is None else init.astype(jnp.float32)
        if self.packed and self.reverse:
            x = x[::-1]
        x = x.reshape(per_row)
        return jnp.concatenate([x, jnp.zeros((b, 1, *shape[1:]), jnp.float32)], axis=1)

    def rows_to_final(self, rows: jax.Array) -> jax.Array:
        """[B, R + 1, H, K, V] -> the op's final states [N, H, K, V] (linear)."""
        x = rows[:, :-1].reshape(-1, *rows.shape[2:])
        return x[::-1] if self.packed and self.reverse else x


def layout(a: dict[str, Any], st: LinearStatics, gates: Gates, plan: Plan) -> dict[str, Any]:
    """Float32 chunked q, k, v [N, B, H, C, F], log gates (floored: a gate of -inf is a state
    reset, see :mod:`ejkernel_xla.ops._chunk_numerics`) and initial-state rows."""
    del st
    q, k, v = (a[n].astype(jnp.float32) for n in ("query", "key", "value"))
    gk, gv = floor_gates(gates(a))
    if gk is not None:
        gk = jnp.broadcast_to(gk, (*q.shape[:3], gk.shape[-1]))
    b, _, h, dk = q.shape
    return {
        "q": plan.to_chunks(q),
        "k": plan.to_chunks(k),
        "v": plan.to_chunks(v),
        "gk": None if gk is None else plan.to_chunks(gk),
        "gv": None if gv is None else plan.to_chunks(gv),
        "init": plan.state_rows(a.get("initial_state"), (b, h, dk, v.shape[-1])),
    }


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``axis`` of ``x`` to ``size``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
