"""What a device offers kernels: its shared memory per block, and the rule that prunes a config
space by it before anything compiles.

A GPU kernel whose blocks ask for more shared memory than the device grants fails to compile or
to launch; an autotuner that tries it wastes a compile and reports a failure. Config spaces
therefore drop such candidates up front (:func:`prune_by_shared_memory`), from each backend's
estimate of what its compiler will allocate, against :func:`shared_memory_limit`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ejkernel import _env

__all__ = ["SHARED_MEMORY_BY_CAPABILITY", "prune_by_shared_memory", "shared_memory_limit"]

log = logging.getLogger("ejkernel.tuning")

C = TypeVar("C")

#: Shared memory a block may opt in to, in bytes, by compute capability: the CUDA C++
#: Programming Guide's "maximum amount of shared memory per thread block" (227 KiB on Hopper and
#: Blackwell datacenter parts, 163 KiB on the A100 and Orin, 99 KiB on the other Ampere, Ada and
#: consumer Blackwell parts, 96 KiB on Volta, 64 KiB on Turing).
SHARED_MEMORY_BY_CAPABILITY: dict[tuple[int, int], int] = {
    (7, 0): 98304,
    (7, 2): 98304,
    (7, 5): 65536,
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
    (10, 0): 232448,
    (10, 3): 232448,
    (12, 0): 101376,
    (12, 1): 101376,
}

#: Where a device reports neither the limit nor its compute capability: the limit by a pattern
#: of its device kind (``"NVIDIA H100 80GB HBM3"``), first match wins.
_BY_KIND: tuple[tuple[str, int], ...] = (
    (r"\bG?H(100|200|800)\b", 232448),
    (r"\bB(100|200|300)\b", 232448),
    (r"\bA(100|800)\b", 166912),
    (r"\bRTX\s*(30|40|A)\d*|\bA(10|16|2|30|40)G?\b|\bA[456]000\b|\bL4\b|\bL40S?\b", 101376),
    (r"\bV100\b", 98304),
    (r"\bT4\b|\bRTX\s*20\d\d\b", 65536),
)


def shared_memory_limit(device: Any = None) -> int | None:
    """The shared memory one block of a kernel may use on ``device`` (the default device when
    ``None``), in bytes: the opt-in maximum, what a kernel gets once it asks for it.

    ``EJKERNEL_SHARED_MEMORY_LIMIT`` overrides it (bytes; ``none`` for no limit, so nothing is
    pruned). Otherwise it is what JAX reports for the device
    (``device.shared_memory_per_block_optin``), else :data:`SHARED_MEMORY_BY_CAPABILITY` by its
    compute capability, else a table by device kind. ``None`` for a CPU, a TPU, or a GPU none
    of these know: a config space then prunes nothing.

    Example (a plugin's config space)::

        from ejkernel.ops import shared_memory_limit

        limit = shared_memory_limit()  # 232448 on an H100, None on a CPU
    """
    forced = _env.shared_memory_limit()
    if forced is not None:
        return forced or None
    if device is None:
        import jax

        try:
            device = jax.devices()[0]
        except RuntimeError:  # no backend could start
            return None
    if str(getattr(device, "platform", "")).lower() not in ("gpu", "cuda", "rocm"):
        return None
    reported = getattr(device, "shared_memory_per_block_optin", None)
    if isinstance(reported, int) and reported > 0:
        return reported
    capability = _capability(getattr(device, "compute_capability", None))
    if capability in SHARED_MEMORY_BY_CAPABILITY:
        return SHARED_MEMORY_BY_CAPABILITY[capability]
    kind = str(getattr(device, "device_kind", ""))
    return next((limit for pattern, limit in _BY_KIND if re.search(pattern, kind)), None)


def _capability(value: Any) -> tuple[int, int] | None:
    """``"9.0"`` (JAX's form) as ``(9, 0)``; ``None`` if it is not one."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(value or ""))
    return (int(match[1]), int(match[2])) if match else None


def prune_by_shared_memory(
    configs: Iterable[C],
    need: Callable[[C], int],
    *,
    keep: Sequence[C] = (),
    limit: int | None = None,
    what: str = "config space",
) -> list[C]:
    """``configs`` without those whose ``need(cfg)`` (bytes of shared memory a block of the
    config's largest kernel asks for) exceeds the device's limit, in their order.

    Args:
        configs: the candidates, the heuristic's first.
        need: a config's shared memory in bytes, as its compiler will allocate it.
        keep: configs never dropped (the heuristic's: the call must have a config).
        limit: bytes a block may use; ``None`` asks :func:`shared_memory_limit` (and where
            that is ``None`` too, nothing is dropped).
        what: names the space in the debug log line of each dropped candidate.

    Returns:
        The candidates that fit, plus ``keep``'s; if none would be left, the one needing the
        least (the first of equals).
    """
    candidates = list(configs)
    limit = shared_memory_limit() if limit is None else limit
    if limit is None or not candidates:
        return candidates
    needs = [need(cfg) for cfg in candidates]
    kept = [cfg for cfg, n in zip(candidates, needs, strict=True) if n <= limit or cfg in keep]
    if not kept:
        kept = [candidates[needs.index(min(needs))]]
    for cfg, n in zip(candidates, needs, strict=True):
        if cfg not in kept:
            log.debug(
                "%s: dropped %r: needs %d bytes of shared memory, over the device's %d",
                what,
                cfg,
                n,
                limit,
            )
    return kept
