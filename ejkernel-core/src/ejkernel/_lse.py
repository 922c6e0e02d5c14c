"""Flash attention with its log-sum-exp: the per-step contract of ring attention.

Ring attention (and any op that merges partial softmaxes) needs, from one flash-attention call
on part of the keys, the output *and* the per-row log-sum-exp, and later the gradients of that
call given the output and log-sum-exp of the *whole* softmax it was part of. A
``flash_attention`` implementation offers both through :func:`deflse`; a caller asks for them
through :func:`flash_attention_lse_step`, which runs the usual selection (``platform=``,
cached and shipped choices, priority); when the selected platform does not offer them, the
highest-priority runnable implementation that does serves (else XLA's). The contract, for plugin authors (docs/writing-a-plugin.md):

- ``fwd(**op_args, cfg=cfg) -> (out, lse)``: ``out`` as the op returns it, ``lse``
  ``[B, Sq, Hq]`` float32, the natural log of each row's softmax denominator over the logits
  after scale, soft cap, bias and masking (no dropout); a row with no visible key has ``out``
  zeros and ``lse`` :data:`~ejkernel.attention_semantics.EMPTY_ROW_LSE`.
- ``bwd(out, lse, d_out, **op_args, cfg=cfg) -> {name: gradient}``: the gradients of the
  differentiable arguments, with the probabilities recomputed as ``exp(logits - lse)`` and
  ``D = rowsum(d_out ∘ out)``. ``out`` and ``lse`` may be those of a larger softmax this call's
  keys are one part of (the merged ring result), so ``bwd`` must read the softmax statistics
  from its arguments only, never from a saved forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["FlashLseStep", "deflse", "flash_attention_lse_step"]

#: The platform whose step serves when the selected one has none (it serves every call).
FALLBACK_PLATFORM = "xla"


def deflse(
    fn: Callable[..., Any], fwd: Callable[..., Any], bwd: Callable[..., Any]
) -> Callable[..., Any]:
    """Attach the (out, lse) forward and the statistics-driven backward to a flash-attention
    implementation (see the module docstring for the contract).

    Args:
        fn: the registered ``flash_attention`` implementation.
        fwd: ``fwd(**op_args, cfg=cfg) -> (out, lse)``.
        bwd: ``bwd(out, lse, d_out, **op_args, cfg=cfg) -> dict[name, gradient]``.

    Returns:
        ``fn``, carrying ``fn.lse_fwd`` and ``fn.lse_bwd``.
    """
    fn.lse_fwd = fwd  # type: ignore[attr-defined]
    fn.lse_bwd = bwd  # type: ignore[attr-defined]
    return fn


@attrs.frozen(kw_only=True)
class FlashLseStep:
    """One selected flash-attention step: its platform, configs and the two passes.

    Attributes:
        platform: the platform whose implementation runs.
        fwd_config: its config for the forward.
        bwd_config: its config for the backward (selected for a differentiated call).
    """

    platform: str
    fwd_config: Any
    bwd_config: Any
    _fwd: Callable[..., Any]
    _bwd: Callable[..., Any]

    def forward(self, **args: Any) -> tuple[Any, Any]:
        """``(out [B, Sq, Hq, Dv], lse [B, Sq, Hq] float32)`` of ``flash_attention(**args)``."""
        return self._fwd(**args, cfg=self.fwd_config)  # type: ignore[no-any-return]

    def backward(self, out: Any, lse: Any, d_out: Any, **args: Any) -> dict[str, Any]:
        """Gradients of ``flash_attention(**args)`` given the (possibly merged) softmax
        statistics ``out`` and ``lse`` and the output cotangent ``d_out``."""
        return self._bwd(out, lse, d_out, **args, cfg=self.bwd_config)  # type: ignore[no-any-return]


def flash_attention_lse_step(**args: Any) -> FlashLseStep:
    """The flash-attention step the usual selection picks for these arguments.

    Selection runs as for ``ejkernel.flash_attention(**args)`` (arrays may be tracers or
    ``jax.ShapeDtypeStruct``; nothing is run, tuned or stored); a platform whose implementation
    has no :func:`deflse` passes gives way to the highest-priority runnable implementation
    that has them (else XLA's).

    Args:
        **args: :func:`ejkernel.flash_attention`'s arguments by name (``platform=`` and
            ``cfg=``, a config for both passes, included).

    Returns:
        A :class:`FlashLseStep`.
    """
    from ejkernel._executor import default_executor
    from ejkernel.plugins import get_registry

    registry = get_registry()
    spec = registry.spec("flash_attention")
    platform, cfg = args.pop("platform", None), args.pop("cfg", None)
    executor = default_executor()
    selections = {}
    for grad in (False, True):
        selections[grad] = executor.explain_op(
            spec, spec.bind((), dict(args)), platform=platform, cfg=cfg, grad=grad
        )
    impl = _implementation(registry, selections[False].platform)
    if impl is None or getattr(impl.fn, "lse_fwd", None) is None:
        fallback = _fallback_platform(registry, spec, args)
        selections = {
            grad: executor.explain_op(
                spec, spec.bind((), dict(args)), platform=fallback, cfg=cfg, grad=grad
            )
            for grad in (False, True)
        }
        impl = _implementation(registry, fallback)
    if impl is None or getattr(impl.fn, "lse_fwd", None) is None:
        raise RuntimeError(
            "flash_attention: no installed implementation offers its log-sum-exp "
            "(ejkernel.plugins.deflse); install ejkernel-xla"
        )
    return FlashLseStep(
        platform=impl.platform,
        fwd_config=selections[False].config,
        bwd_config=selections[True].config,
        fwd=impl.fn.lse_fwd,
        bwd=impl.fn.lse_bwd,
    )


def _fallback_platform(registry: Any, spec: Any, args: dict[str, Any]) -> str:
    """The highest-priority runnable platform whose implementation has the step, else XLA."""
    from ejkernel._invocation import Invocation, current_backend
    from ejkernel._selection import runnable

    inv = Invocation(kernel=spec.name, kwargs=spec.validate(spec.bind((), dict(args))))
    candidates, _ = runnable(registry, spec, inv, current_backend())
    for impl in candidates:
        if getattr(impl.fn, "lse_fwd", None) is not None:
            return str(impl.platform)
    return FALLBACK_PLATFORM


def _implementation(registry: Any, platform: str) -> Any:
    from ejkernel._invocation import current_backend

    backend = current_backend()
    for impl in registry.implementations("flash_attention"):
        if impl.platform == platform and impl.runs_on(backend):
            return impl
    return None
