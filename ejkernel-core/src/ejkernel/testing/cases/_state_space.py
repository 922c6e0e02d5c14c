"""The example builder shared by the state-space ops (``state_space_v1``, ``state_space_v2``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing.cases._common import arrays_of, sizes_id
from ejkernel.testing.cases._numerics import state_space_numerics

__all__ = ["CORE", "state_space_examples"]


#: The arrays every state-space op requires; the others are optional.
CORE = ("x", "A", "B", "C", "D", "dt")


def state_space_examples(
    sizes: Mapping[str, int],
    letters: Mapping[str, str],
    *,
    tags: str,
    options: dict[str, Any],
    invalid: Invalid,
) -> list[Example | Invalid]:
    """Examples named after ``sizes``, every array of the shape its ``letters`` (name ->
    shape in OPS.md letters) spell: the :data:`CORE` arrays alone (``-plain``), with the
    optional arrays and ``options`` (``-<tags>``); then ``x`` with an extra axis and the op's
    own ``invalid`` change; then the numerics examples (:func:`state_space_numerics`) under
    ``options``."""
    core = {name: letters[name] for name in CORE}
    core_arrays, all_arrays = arrays_of(sizes, **core), arrays_of(sizes, **letters)
    return [
        Example(name=f"{sizes_id(sizes)}-plain", arrays=core_arrays),
        Example(name=f"{sizes_id(sizes)}-{tags}", arrays=all_arrays, options=options),
        Invalid.extra_axis("x"),
        invalid,
        *state_space_numerics(sizes, core=core, options=options),
    ]
