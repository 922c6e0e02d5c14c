"""gla (Triton): the chunk layout the kernels read, built in JAX.

Tokens ``[B, S, H, F]`` become ``[B, T, H, F]`` with ``T = NT · C``: without ``cu_seqlens``
each row is zero-padded to whole chunks; with it, the (single) row's sequences are laid out
chunk-aligned (sequence m owns chunks ``[off[m], off[m + 1])``, ``off`` the running sum of
``ceil(len / C)``), so no chunk straddles two sequences and the offsets may be traced. Padding
slots hold zeros: a zero key and value add nothing to the state, a zero gate keeps it.

State rows: ``R`` per batch row (1 dense; the N packed sequences and one zero row for the
padding chunks when packed), ``[B · R, H, K, V]`` float32. Each chunk has one int32 flag word
``sid << 2 | last << 1 | first`` (its state row; whether it ends and starts its sequence).
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_triton._launch import BATCH, OTHER

__all__ = ["Layout"]


@jax.tree_util.register_pytree_node_class
@attrs.frozen
class Layout:
    """Where tokens sit in the chunk layout and how chunks map to state rows.

    Attributes:
        seq: S. chunk: C. num_chunks: NT. rows: R (state rows per batch row).
        packed: built from ``cu_seqlens``.
        flags: [NT] int32 flag words.
        sid: [NT] state row of each chunk. last: [NT] the chunk ends its sequence.
        slot_token / slot_valid: [NT · C] source token of each slot (packed only).
        token_slot / token_valid: [S] slot of each token (packed only).
        nonempty: [N] the sequence owns a chunk (packed only).
    """

    seq: int
    chunk: int
    num_chunks: int
    rows: int
    packed: bool
    flags: Any
    sid: Any
    last: Any
    slot_token: Any = None
    slot_valid: Any = None
    token_slot: Any = None
    token_valid: Any = None
    nonempty: Any = None

    _ARRAYS = (
        "flags",
        "sid",
        "last",
        "slot_token",
        "slot_valid",
        "token_slot",
        "token_valid",
        "nonempty",
    )

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children = tuple(getattr(self, n) for n in self._ARRAYS)
        return children, (self.seq, self.chunk, self.num_chunks, self.rows, self.packed)

    @classmethod
    def tree_unflatten(cls, statics: tuple[Any, ...], children: tuple[Any, ...]) -> Layout:
        return cls(*statics, *children)

    @classmethod
    def of(cls, seq: int, chunk: int, cu_seqlens: jax.Array | None) -> Layout:
        """The layout of ``seq`` tokens in chunks of ``chunk`` (packed by ``cu_seqlens``)."""
        s, c = seq, chunk
        if cu_seqlens is None:
            n = -(-s // c)
            idx = jnp.arange(n, dtype=jnp.int32)
            first, last = idx == 0, idx == n - 1
            sid = jnp.zeros(n, jnp.int32)
            return cls(s, c, n, 1, False, _flags(sid, first, last), sid, last)
        cu = cu_seqlens.astype(jnp.int32)
        m = cu.shape[0] - 1
        n = max(1, (s + m * (c - 1)) // c)  # Σ ceil(len / C) ≤ (S + m (C - 1)) / C
        lens = jnp.maximum(cu[1:] - cu[:-1], 0)
        counts = (lens + c - 1) // c
        off = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
        idx = jnp.arange(n, dtype=jnp.int32)
        owner = jnp.minimum(jnp.searchsorted(off[1:], idx, side="right"), m - 1).astype(jnp.int32)
        real = idx < off[m]
        first = ~real | (idx == off[owner])
        last = ~real | (idx == off[owner + 1] - 1)
        slot = jnp.arange(n * c, dtype=jnp.int32)
        slot_owner = owner[slot // c]
        offset = slot - off[slot_owner] * c
        slot_valid = real[slot // c] & (offset < lens[slot_owner])
        slot_token = jnp.clip(cu[slot_owner] + offset, 0, s - 1)
        tok = jnp.arange(s, dtype=jnp.int32)
        tok_owner = jnp.searchsorted(cu[1:], tok, side="right").astype(jnp.int32)
        token_valid = (tok >= cu[0]) & (tok_owner < m)
        tok_owner = jnp.minimum(tok_owner, m - 1)
        token_slot = jnp.clip(off[tok_owner] * c + tok - cu[tok_owner], 0, n * c - 1)
        sid = jnp.where(real, owner, m)  # padding chunks: the zero row m
        return cls(
            s,
            c,
            n,
            m + 1,
            True,
            _flags(sid, first, last),
            sid,
            last,
            slot_token,
            slot_valid,
            token_slot,
            token_valid,
            counts > 0,
        )

    def to_chunks(self, x: jax.Array) -> jax.Array:
        """[B, S, H, F] -> [B, NT · C, H, F], padding slots zero."""
        if not self.packed:
            pad = self.num_chunks * self.chunk - x.shape[1]
            return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x
        y = jnp.take(x[0], self.slot_token, axis=0)
        return jnp.where(self.slot_valid[:, None, None], y, jnp.zeros((), x.dtype))[None]

    def from_chunks(self, x: jax.Array) -> jax.Array:
        """[B, NT · C, H, F] -> [B, S, H, F]; tokens outside every sequence are zero."""
        if not self.packed:
            return x[:, : self.seq]
        y = jnp.take(x[0], self.token_slot, axis=0)
        return jnp.where(self.token_valid[:, None, None], y, jnp.zeros((), x.dtype))[None]

    def state_rows(self, states: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
        """The op's [N, H, K, V] states (``None``: zeros) -> kernel rows [B · R, H, K, V]
        float32; ``shape`` is ``(B, H, K, V)``."""
        b, rest = shape[0], shape[1:]
        n = b if not self.packed else self.rows - 1
        x = jnp.zeros((n, *rest), jnp.float32) if states is None else states.astype(jnp.float32)
        if self.packed:
            x = jnp.concatenate([x, jnp.zeros((1, *rest), jnp.float32)])
        return x

    def op_states(self, rows: jax.Array, fallback: jax.Array) -> jax.Array:
        """Kernel rows -> the op's [N, H, K, V]; an empty sequence's (never written) row is
        replaced by its row of ``fallback`` (kernel rows, as :meth:`state_rows` gives)."""
        if not self.packed:
            return rows
        empty = fallback[: rows.shape[0] - 1]
        return jnp.where(self.nonempty[:, None, None, None], rows[:-1], empty)

    def fold_modes(self, arrays: int) -> tuple[str, ...]:
        """How :func:`~ejkernel_triton._launch.fold_vmap` folds a launch function's ``arrays``
        arguments (the flags last): dense, a vmapped axis folds into the batch (state rows are
        one per batch row); packed, the state rows are the sequences', so a vmapped call runs
        once per index."""
        if self.packed:
            return (OTHER,) * arrays
        return (BATCH,) * (arrays - 1) + (OTHER,)


def _flags(sid: jax.Array, first: jax.Array, last: jax.Array) -> jax.Array:
    return (sid << 2) | (last.astype(jnp.int32) << 1) | first.astype(jnp.int32)
