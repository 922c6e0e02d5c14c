"""The static geometry of one Mosaic GPU flash-attention launch, and its block defaults."""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel_pallas._attention import FlashAttentionConfig, Shapes

#: Defaults per head dim: forward (bq per consumer, bk, stages), backward (bq, bk, stages).
FWD_DEFAULT = {64: (64, 128, 2), 128: (64, 128, 2)}
BWD_DEFAULT = {64: (64, 64, 2), 128: (64, 64, 2)}
#: Non-causal forwards at these head dims take kv tiles of 192 rows (FA3's wide kv tiles at
#: D 128): fewer steps, so less per-step softmax and barrier overhead (about 3 % faster forward
#: on an H100 than 128 rows). When 192 does not divide Sk, the last one or two steps take
#: :data:`TAIL_ROWS` rows (4096 = 20 · 192 + 2 · 128).
FWD_WIDE_KV = {128: 192}
#: Rows of the narrower kv steps that end a forward whose kv tile does not divide Sk.
TAIL_ROWS = 128


def fwd_defaults(d: int, causal: bool) -> tuple[int, int, int]:
    """The forward's (bq, bk, stages) for head dim ``d``."""
    bq, bk, stages = FWD_DEFAULT.get(d, (64, 64, 2))
    return bq, (bk if causal else FWD_WIDE_KV.get(d, bk)), stages


def tail_steps(sk: int, bk: int) -> int | None:
    """Fewest :data:`TAIL_ROWS`-row steps after which ``bk``-row steps cover ``sk`` exactly."""
    for tail in range(bk // 64 + 1):
        rest = sk - tail * TAIL_ROWS
        if rest >= 0 and rest % bk == 0:
            return tail
    return None


@attrs.frozen(kw_only=True)
class Problem(Shapes):
    """Everything static about one launch (its sizes are :class:`Shapes`')."""

    bq: int
    bk: int
    stages: int
    scale: float
    causal: bool
    dtype: Any
    interpret: bool
    #: Non-causal forward only: steps of TAIL_ROWS rows ending the kv loop (bk ∤ Sk).
    tail: int = 0

    @classmethod
    def of(
        cls,
        query: jax.Array,
        key: jax.Array,
        cfg: FlashAttentionConfig | None,
        *,
        backward: bool,
        softmax_scale: float | None,
        causal: bool,
    ) -> Problem:
        shapes = Shapes.of(query, key)
        sq, sk, d = shapes.sq, shapes.sk, shapes.d
        defaults = BWD_DEFAULT.get(d, (64, 64, 2)) if backward else fwd_defaults(d, causal)
        params = None if cfg is None else (cfg.bwd_params if backward else cfg.fwd_params)
        bq = (params and params.q_blocksize) or defaults[0]
        bk = (params and params.kv_blocksize) or defaults[1]
        stages = (params and params.num_stages) or defaults[2]
        for name, blk in (("q_blocksize", bq), ("kv_blocksize", bk)):
            if blk % 64:
                raise ValueError(
                    f"flash_attention (pallas gpu): {name} must be a multiple of 64; got {blk}"
                )
        tail = 0
        if not backward and not causal and sk % bk:
            tail = tail_steps(sk, bk)
        if sq % (2 * bq) or tail is None or (sk % (2 * bk if backward else bk) and not tail):
            raise ValueError(
                f"flash_attention (pallas gpu): Sq={sq} must be a multiple of 2·q_blocksize="
                f"{2 * bq} and Sk={sk} of kv_blocksize={bk}{' x 2' if backward else ''}"
                + ("" if backward or causal else f" (or of it plus {TAIL_ROWS}-row steps)")
            )
        return cls(
            **attrs.asdict(shapes),
            bq=bq,
            bk=bk,
            stages=max(2, int(stages)),
            scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
            causal=bool(causal),
            dtype=jnp.dtype(query.dtype),
            interpret=jax.default_backend() == "cpu",
            tail=tail,
        )

    @property
    def offset(self) -> int:
        """Key position of query 0 (bottom-right alignment)."""
        return self.sk - self.sq

    @property
    def nk(self) -> int:
        """Kv steps: ``bk`` rows each, then ``tail`` steps of TAIL_ROWS rows."""
        return (self.sk - self.tail * TAIL_ROWS) // self.bk + self.tail

    @property
    def wide_steps(self) -> int:
        """Kv steps of ``bk`` rows (all of them unless there is a tail)."""
        return self.nk - self.tail

    @property
    def nq(self) -> int:
        return self.sq // self.bq

    @property
    def fwd_tiles(self) -> int:
        """Forward tiles (CTAs of the grid launch): (head, pair of query blocks, batch)."""
        return self.hq * (self.sq // (2 * self.bq)) * self.b

    def kv_steps(self, q0: Any) -> Any:
        """Kv blocks rows ``[q0, q0 + bq)`` see: keys ``< q0 + bq + offset`` when causal."""
        if not self.causal:
            return self.nk
        end = jnp.maximum(q0 + self.bq + self.offset, 0)
        return jnp.minimum(lax.div(end + self.bk - 1, jnp.int32(self.bk)), self.nk)

    def kv_full_steps(self, q0: Any, steps: Any) -> Any:
        """Leading kv blocks every row of ``[q0, q0 + bq)`` sees whole (no mask needed)."""
        if not self.causal:
            return steps
        seen = jnp.maximum(q0 + self.offset + 1, 0)
        return jnp.minimum(lax.div(seen, jnp.int32(self.bk)), steps)

    def kv_blocks(self, q0: Any) -> tuple[Any, Any]:
        """``(steps, full)``: :meth:`kv_steps` and :meth:`kv_full_steps` of rows from ``q0``."""
        steps = self.kv_steps(q0)
        return steps, self.kv_full_steps(q0, steps)

    def q_blocks(self, k0: Any) -> tuple[Any, Any]:
        """``(start, full_from)``: :meth:`q_start` and :meth:`q_full_start` of keys from ``k0``."""
        start = self.q_start(k0)
        return start, self.q_full_start(k0, start)

    def q_start(self, k0: Any) -> Any:
        """First query block that sees keys ``[k0, k0 + bk)`` (causal; else 0)."""
        if not self.causal:
            return jnp.int32(0)
        first = jnp.maximum(k0 - self.offset, 0)
        return jnp.minimum(lax.div(first, jnp.int32(self.bq)), self.nq)

    def q_full_start(self, k0: Any, start: Any) -> Any:
        """First query block from which every (query, key) pair of the tile is visible."""
        if not self.causal:
            return start
        need = jnp.maximum(k0 + self.bk - 1 - self.offset, 0)
        return jnp.clip(lax.div(need + self.bq - 1, jnp.int32(self.bq)), start, self.nq)
