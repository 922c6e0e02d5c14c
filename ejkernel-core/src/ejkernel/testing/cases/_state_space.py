"""The example builder shared by the state-space ops (``state_space_v1``, ``state_space_v2``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of, sizes_id
from ejkernel.testing.cases._numerics import state_space_numerics

__all__ = ["state_space_examples"]


def state_space_examples(
    sizes: Mapping[str, int],
    *,
    core: dict[str, str],
    extra: dict[str, str],
    tags: str,
    options: dict[str, Any],
    invalid: Invalid,
) -> list[Example | Invalid]:
    """Examples named after ``sizes``: the ``core`` arrays alone (``-plain``), with the
    ``extra`` arrays and ``options`` (``-<tags>``); then ``x`` with an extra axis and the op's
    own ``invalid`` change; then the numerics examples (:func:`state_space_numerics`) under
    ``options``. Arrays are given by their shapes in OPS.md letters."""
    core_arrays, extra_arrays = arrays_of(sizes, **core), arrays_of(sizes, **extra)
    return [
        Example(name=f"{sizes_id(sizes)}-plain", arrays=core_arrays),
        Example(
            name=f"{sizes_id(sizes)}-{tags}",
            arrays={**core_arrays, **extra_arrays},
            options=options,
        ),
        Invalid.extra_axis("x"),
        invalid,
        *state_space_numerics(sizes, core=core, options=options),
    ]
