"""The adapter the differentiable XLA attention ops share around their jitted passes.

flash, ring, materialised, block-sparse and multi-head latent attention each have a jitted
``forward(arrays, statics)`` and ``backward(residuals, d_out, statics)``; what turns them into
an implementation, its VJP forward and its backward is the same for all and lives here:

- :class:`Passes` binds the op's arguments by its core spec (so a module never restates the
  argument list), splits arrays from static arguments, builds the hashable statics and runs
  the passes; the primal returns the forward's outputs and keeps nothing else.
  :func:`static_defaults` completes the static arguments a backward receives.
- :class:`Masking` and :class:`Blocked` are those statics: flash attention's masking
  arguments, normalised, and the block sizes of one pass.
- :class:`BlockConfig` is the config of ops tuned by their block sizes, with
  :func:`pass_blocks` resolving one pass's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import jax.numpy as jnp

from ejkernel.plugins import BwdParams, FwdParams
from ejkernel.specs import OpSpec

__all__ = [
    "BlockConfig",
    "Blocked",
    "Masking",
    "Passes",
    "clamp_blocks",
    "pass_blocks",
    "static_defaults",
]

_C = TypeVar("_C")


@attrs.frozen(kw_only=True)
class Masking:
    """Flash attention's static masking arguments, normalised (hashable: a ``jax.jit`` static)."""

    softmax_scale: float
    causal: bool = False
    sliding_window: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    dropout_prob: float = 0.0

    @classmethod
    def of(cls, query: Any, static: Mapping[str, Any], **fields: Any) -> Any:
        """The statics of a call from its static arguments (absent ones at their defaults) and
        the subclass's own ``fields``; ``softmax_scale`` defaults to ``query``'s D ** -0.5."""
        scale, window, cap = (
            static.get(n) for n in ("softmax_scale", "sliding_window", "logits_soft_cap")
        )
        return cls(
            softmax_scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
            causal=bool(static.get("causal", False)),
            sliding_window=None if window is None else tuple(map(int, window)),
            logits_soft_cap=None if cap is None else float(cap),
            dropout_prob=float(static.get("dropout_prob") or 0.0),
            **fields,
        )


@attrs.frozen(kw_only=True)
class Blocked(Masking):
    """:class:`Masking` plus the query and key block sizes of one pass."""

    block_q: int
    block_k: int


@attrs.frozen(kw_only=True)
class BlockConfig:
    """Block sizes of the forward and the backward pass (``None``: the op's default).

    Attributes:
        fwd_params: block sizes of the forward pass.
        bwd_params: block sizes of the backward pass.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    bwd_params: BwdParams = attrs.field(factory=BwdParams)

    @classmethod
    def of(cls, fwd: tuple[int, int], bwd: tuple[int, int] | None = None, **fields: Any) -> Any:
        """A config of ``(q_blocksize, kv_blocksize)`` per pass (``bwd`` defaults to ``fwd``)."""
        bq, bk = fwd if bwd is None else bwd
        return cls(
            fwd_params=FwdParams(q_blocksize=fwd[0], kv_blocksize=fwd[1]),
            bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk),
            **fields,
        )


def clamp_blocks(blocks: tuple[int, int], sq: int, sk: int) -> tuple[int, int]:
    """Blocks no longer than their sequence (a shorter sequence is then one unpadded block)."""
    return max(1, min(blocks[0], sq)), max(1, min(blocks[1], sk))


def pass_blocks(
    cfg: BlockConfig, backward: bool, default: tuple[int, int], sq: int, sk: int
) -> dict[str, int]:
    """``block_q`` and ``block_k`` of one pass: ``cfg``'s, else ``default``, clamped."""
    params = cfg.bwd_params if backward else cfg.fwd_params
    bq, bk = clamp_blocks(
        (params.q_blocksize or default[0], params.kv_blocksize or default[1]), sq, sk
    )
    return {"block_q": bq, "block_k": bk}


def static_defaults(spec: OpSpec, static: Mapping[str, Any]) -> dict[str, Any]:
    """The static arguments a backward receives, completed with the spec's defaults."""
    return {a.name: a.default for a in spec.args if not a.array} | dict(static)


@attrs.frozen(kw_only=True)
class Passes:
    """An op's jitted passes as its implementation, VJP forward and VJP backward.

    Attributes:
        spec: the op's core spec: its argument names, which are arrays, their defaults.
        statics: ``statics(arrays, cfg, backward, static_args) -> st``, hashable.
        forward: ``forward(arrays, st) -> (outputs, saved)``; ``saved`` (a dict) joins the
            array arguments in the residuals.
        backward: ``backward(residuals, d_outputs, st) -> {name: gradient}``.
    """

    spec: OpSpec
    statics: Callable[[dict[str, Any], Any, bool, Mapping[str, Any]], Any]
    forward: Callable[[dict[str, Any], Any], tuple[Any, dict[str, Any]]]
    backward: Callable[[dict[str, Any], Any, Any], dict[str, Any]]

    def primal(self, args: Mapping[str, Any], cfg: Any) -> Any:
        """The outputs of a call (``args`` by name, absent ones at the spec's defaults)."""
        arrays, st = self._prepare(args, cfg)
        outputs, _ = self.forward(arrays, st)
        return outputs

    def fwd(self, *, cfg: Any = None, **args: Any) -> tuple[Any, dict[str, Any]]:
        """``(outputs, residuals)``: the array arguments and what the forward saved."""
        arrays, st = self._prepare(args, cfg)
        outputs, saved = self.forward(arrays, st)
        return outputs, {**arrays, **saved}

    def bwd(
        self, residuals: dict[str, Any], d_outputs: Any, *, cfg: Any = None, **static: Any
    ) -> dict[str, Any]:
        """Gradients of the differentiable arrays from the residuals of :meth:`fwd`."""
        static = static_defaults(self.spec, static)
        return self.backward(residuals, d_outputs, self.statics(residuals, cfg, True, static))

    def _prepare(self, args: Mapping[str, Any], cfg: Any) -> tuple[dict[str, Any], Any]:
        bound = self.spec.bind((), args)
        arrays = {a.name: bound[a.name] for a in self.spec.args if a.array}
        static = {k: v for k, v in bound.items() if k not in arrays}
        if "dropout_seed" in arrays:
            # Only a call that drops carries its seed, as a uint32 scalar (the hash's input).
            seed = arrays["dropout_seed"]
            arrays["dropout_seed"] = (
                jnp.asarray(0 if seed is None else seed).astype(jnp.uint32)
                if static.get("dropout_prob")
                else None
            )
        return arrays, self.statics(arrays, cfg, False, static)
