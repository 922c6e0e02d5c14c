"""What the Pallas flash-attention kernels share: config, declined features, block ranges.

Masking follows the core spec (``ejkernel.specs.flash_attention``): query ``i`` sits at key
position ``Sk - Sq + i`` (bottom-right alignment); ``causal`` keeps keys at positions ≤ its
own; ``sliding_window=(left, right)`` keeps keys in ``[p - left, p + right]``. The block-range
helpers below turn these rules into the kv blocks a query block needs (and the reverse), so
kernels skip hidden blocks and their index maps never fetch them. They take Python ints or
traced int32 scalars alike.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel.plugins import BwdParams, FwdParams

__all__ = ["FlashAttentionConfig", "Visibility", "declined_features"]


@attrs.frozen(kw_only=True)
class FlashAttentionConfig:
    """Tunables of the Pallas flash attention (same shape as the XLA plugin's config).

    Attributes:
        fwd_params: forward blocks (``q_blocksize``, ``kv_blocksize``; ``num_stages`` is the
            depth of the GPU kernels' key/value pipeline). ``None`` fields take the defaults.
        bwd_params: the same for the backward kernels.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    bwd_params: BwdParams = attrs.field(factory=BwdParams)


def declined_features(kw: Any) -> str | None:
    """The first feature of the call the Pallas kernels do not implement, as a reason."""
    for name, why in (
        ("bias", "an additive bias"),
        ("attention_mask", "a dense attention_mask"),
        ("softmax_aux", "attention sinks (softmax_aux)"),
    ):
        if kw.get(name) is not None:
            return f"the Pallas kernels do not implement {why}; the XLA plugin serves it"
    if float(kw.get("dropout_prob") or 0.0) > 0.0:
        return "the Pallas kernels do not implement dropout; the XLA plugin serves it"
    return None


def _floor_div(x: Any, y: int) -> Any:
    return x // y  # Python ints and jnp int32 both floor toward -inf


@attrs.frozen(kw_only=True)
class Visibility:
    """Causal / sliding-window geometry of one call (Python ints).

    Attributes:
        sq: query length (unpadded).
        sk: key length (unpadded).
        causal: bottom-right aligned causal mask.
        window: ``(left, right)`` or ``None``.
    """

    sq: int
    sk: int
    causal: bool
    window: tuple[int, int] | None

    @property
    def offset(self) -> int:
        """Key position of query 0."""
        return self.sk - self.sq

    @property
    def restricted(self) -> bool:
        return self.causal or self.window is not None

    @property
    def right(self) -> int | None:
        """Largest ``k - p`` a query may see (``None``: unbounded)."""
        if self.causal and self.window is not None:
            return min(self.window[1], 0)
        if self.causal:
            return 0
        return self.window[1] if self.window is not None else None

    @property
    def left(self) -> int | None:
        """Largest ``p - k`` a query may see (``None``: unbounded)."""
        return self.window[0] if self.window is not None else None

    def block_may_see(self, i: Any, j: Any, bq: int, bk: int) -> Any:
        """Whether query block ``i`` sees any key of kv block ``j`` (``True`` if unrestricted)."""
        q_lo = i * bq + self.offset
        q_hi = q_lo + bq - 1
        k_lo, k_hi = j * bk, j * bk + bk - 1
        conds = []
        if self.right is not None:
            conds.append(k_lo <= q_hi + self.right)
        if self.left is not None:
            conds.append(k_hi >= q_lo - self.left)
        if not conds:
            return True
        return conds[0] if len(conds) == 1 else jnp.logical_and(conds[0], conds[1])

    def kv_blocks(self, i: Any, bq: int, bk: int, nk: int) -> tuple[Any, Any]:
        """``[first, last]`` kv blocks query block ``i`` needs, clamped to ``[0, nk - 1]``.

        ``first > last`` never happens after clamping; a block that sees nothing still maps to
        a valid block (its compute is skipped by :meth:`block_may_see`).
        """
        q_lo = i * bq + self.offset
        q_hi = q_lo + bq - 1
        last = nk - 1 if self.right is None else _floor_div(q_hi + self.right, bk)
        first = 0 if self.left is None else _floor_div(q_lo - self.left, bk)
        last = jnp.clip(last, 0, nk - 1)
        first = jnp.clip(first, 0, last)
        return first, last

    def q_blocks(self, j: Any, bq: int, bk: int, nq: int) -> tuple[Any, Any]:
        """``[first, last]`` query blocks that see kv block ``j``, clamped to ``[0, nq - 1]``."""
        k_lo, k_hi = j * bk, j * bk + bk - 1
        first = 0 if self.right is None else _floor_div(k_lo - self.right - self.offset, bq)
        last = nq - 1 if self.left is None else _floor_div(k_hi + self.left - self.offset, bq)
        last = jnp.clip(last, 0, nq - 1)
        first = jnp.clip(first, 0, last)
        return first, last

    def mask(self, q_pos: Any, k_pos: Any) -> Any:
        """Bool visibility of query index ``q_pos`` and key position ``k_pos`` (broadcast);
        ``None`` when unrestricted."""
        p = q_pos + self.offset
        terms = []
        if self.right is not None:
            terms.append(k_pos <= p + self.right)
        if self.left is not None:
            terms.append(k_pos >= p - self.left)
        if not terms:
            return None
        return terms[0] if len(terms) == 1 else jnp.logical_and(terms[0], terms[1])
