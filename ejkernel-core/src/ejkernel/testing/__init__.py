"""Testing helpers and the conformance kit for ejkernel implementations.

Helpers shared by every backend's tests: shape tables (always with the odd sizes: sequence 37
and 129, head dim 80, GQA/MQA), inputs from a fixed key, one :func:`assert_close` with the
per-dtype tolerance table.

The conformance kit checks an implementation against its op's plain-JAX reference: forward
on the op's examples in each dtype (what ``supports()`` accepts must be right), gradients
against autodiff of the reference, ``jit`` and ``vmap``, and that invalid input is rejected
before any implementation runs. Ops declare their cases in ``OpSpec.examples``
(:class:`Example`, :class:`Invalid`). Run it with
``pytest --pyargs ejkernel.testing.conformance --ejkernel-platform NAME``, subclass
:class:`ConformanceSuite` in a test module, or call the ``check_*`` functions directly.

Names are imported on first use: the pytest plugin (``ejkernel.testing.pytest_plugin``) loads
in every pytest run and must stay cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ejkernel.testing._checks import (
        Declined,
        check_configs,
        check_forward,
        check_gradients,
        check_jit,
        check_rejects_invalid,
        check_vmap,
        tolerance,
    )
    from ejkernel.testing._examples import FLOAT, Example, Invalid, examples_of, invalid_cases_of
    from ejkernel.testing._helpers import (
        ATTENTION_SHAPES,
        TOLERANCES,
        AttentionShape,
        assert_close,
        attention_inputs,
        random_normal,
    )
    from ejkernel.testing._lse_check import check_lse_step
    from ejkernel.testing._suite import Case, ConformanceSuite, conformance_cases

__all__ = [
    "ATTENTION_SHAPES",
    "FLOAT",
    "TOLERANCES",
    "AttentionShape",
    "Case",
    "ConformanceSuite",
    "Declined",
    "Example",
    "Invalid",
    "assert_close",
    "attention_inputs",
    "check_configs",
    "check_forward",
    "check_gradients",
    "check_jit",
    "check_lse_step",
    "check_rejects_invalid",
    "check_vmap",
    "conformance_cases",
    "examples_of",
    "invalid_cases_of",
    "random_normal",
    "tolerance",
]

_HOME = {
    "check_lse_step": "_lse_check",
    "ATTENTION_SHAPES": "_helpers",
    "TOLERANCES": "_helpers",
    "AttentionShape": "_helpers",
    "assert_close": "_helpers",
    "attention_inputs": "_helpers",
    "random_normal": "_helpers",
    "FLOAT": "_examples",
    "Example": "_examples",
    "Invalid": "_examples",
    "examples_of": "_examples",
    "invalid_cases_of": "_examples",
    "Declined": "_checks",
    "check_configs": "_checks",
    "check_forward": "_checks",
    "check_gradients": "_checks",
    "check_jit": "_checks",
    "check_rejects_invalid": "_checks",
    "check_vmap": "_checks",
    "tolerance": "_checks",
    "Case": "_suite",
    "ConformanceSuite": "_suite",
    "conformance_cases": "_suite",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'ejkernel.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ejkernel.testing.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
