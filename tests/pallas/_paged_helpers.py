"""What the Pallas TPU paged-attention tests share: a batch's arguments as the core hands
them to an implementation, the check of an implementation's output against the op's
reference (shape, dtype, no hidden NaN reaching a row, closeness) and of a whole batch, and
the check that huge pages fit the VMEM budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ejkernel.ops import Invocation
from ejkernel.specs import OpSpec
from ejkernel.testing import assert_close


def validated(spec: OpSpec, arrays: dict[str, Any], **options: Any) -> dict[str, Any]:
    """``arrays`` and ``options`` bound and validated by ``spec``."""
    return spec.validate(spec.bind((), {**arrays, **options}))


def check_output(
    impl: Callable[..., Any],
    spec: OpSpec,
    args: dict[str, Any],
    *,
    query: str,
    dtype: str,
    cfg: Any,
    name: str,
) -> Any:
    """``impl(**args, cfg=cfg)``: shaped as the argument ``query``, in ``dtype``, finite, and
    close to ``spec``'s reference."""
    out = impl(**args, cfg=cfg)
    ref = spec.reference(**args)
    assert out.shape == args[query].shape and out.dtype == jnp.dtype(dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "a hidden NaN reached a row"
    assert_close(out, ref, name=name)
    return out


def batch_checker(
    impl: Callable[..., Any],
    spec: OpSpec,
    inputs: Callable[..., dict[str, Any]],
    query: str,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """``check(batch, dtype="float32", cfg=None, **options)``: :func:`check_output` of ``impl``
    on ``inputs(batch, dtype, **options)``, named after the batch; returns the output and the
    arguments."""

    def check(batch: Any, dtype: str = "float32", cfg: Any = None, **options: Any) -> Any:
        args = inputs(batch, dtype, **options)
        out = check_output(impl, spec, args, query=query, dtype=dtype, cfg=cfg, name=str(batch))
        return out, args

    return check


def assert_huge_pages_fit_vmem(
    spec: OpSpec,
    module: Any,
    supports: Callable[[Any], Any],
    big: dict[str, Any],
    huge: dict[str, Any],
) -> None:
    """``module``'s heuristic launch at ``big``'s huge pages takes one page a block within the
    VMEM budget; ``supports`` declines ``huge``'s for VMEM."""
    from ejkernel_pallas.tpu import _paged

    lp = module._heuristic_launch(big)
    assert lp.pages_per_block == 1 and _paged.vmem_bytes(lp) <= _paged.vmem_budget()
    assert "VMEM" in supports(Invocation(kernel=spec.name, kwargs=huge))
