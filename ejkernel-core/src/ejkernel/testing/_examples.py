"""Conformance cases: :class:`Example` (valid inputs of an op) and :class:`Invalid` (a change
that makes them invalid), and where the kit finds an op's cases (``OpSpec.examples``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel._registry import resolve
from ejkernel.specs import OpSpec

__all__ = ["FLOAT", "Example", "Invalid", "examples_of", "invalid_cases_of"]

#: Dtype placeholder in :attr:`Example.arrays`: the case's dtype (float32, bfloat16, ...).
FLOAT = "float"

#: Share of True entries in boolean inputs (masks) the kit draws.
_MASK_DENSITY = 0.8


def _shape_id(arrays: Mapping[str, tuple[tuple[int, ...], str]]) -> str:
    return "-".join(f"{k}{'x'.join(map(str, s))}" for k, (s, _) in arrays.items())


@attrs.frozen(kw_only=True)
class Example:
    """One valid call of an op, described by shapes and options; values are drawn per case.

    Values come from the spec's ``synthetic`` builder (so lengths, offsets and page tables are
    valid), floating arrays are standard normal (never zeros), boolean arrays are random masks
    (about 80% True); ``fill`` then replaces whatever the example wants to set itself.

    Attributes:
        name: a readable test id (``B2-Sq37-Hq4-Hkv2-D80-causal``).
        arrays: argument name -> ``(shape, dtype)``; dtype :data:`FLOAT` (``"float"``) is the
            case's dtype, any other string is used as is (``"int32"``, ``"bool"``,
            ``"float32"``).
        options: every other argument given (static values such as ``causal=True``, or
            Python ints); arguments not named keep the op's defaults.
        fill: ``fill(values, rng) -> dict`` of arguments to replace after drawing
            (``values`` holds NumPy arrays; returned floats are cast to the array's dtype).
        dtypes: the dtypes the forward pass is checked in.
        grad: check gradients (differentiable ops only); ``"thorough"``: only with
            ``--ejkernel-thorough`` (a backward that is slow to compile).
        tolerance: widens the dtype tolerance for this example (``1.0``: the table).
        thorough: run only with ``--ejkernel-thorough``.
    """

    name: str
    arrays: Mapping[str, tuple[tuple[int, ...], str]]
    options: Mapping[str, Any] = attrs.field(factory=dict)
    fill: Callable[[dict[str, Any], np.random.Generator], Mapping[str, Any]] | None = attrs.field(
        default=None, eq=False
    )
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    grad: bool | str = True
    tolerance: float = 1.0
    thorough: bool = False

    def __str__(self) -> str:
        return self.name or _shape_id(self.arrays)

    def abstract(self, dtype: str = "float32") -> dict[str, jax.ShapeDtypeStruct]:
        """``jax.ShapeDtypeStruct`` of every array argument for ``dtype``."""
        return {
            name: jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype if kind == FLOAT else kind))
            for name, (shape, kind) in self.arrays.items()
        }

    def build(self, spec: OpSpec, dtype: str = "float32", seed: int = 0) -> dict[str, Any]:
        """The example's arguments (arrays as ``jax.Array``) for ``dtype``, from ``seed``."""
        abstract = self.abstract(dtype)
        values = dict(spec.make_synthetic({**self.options, **abstract}, seed))
        rng = np.random.default_rng(seed + 7919)
        for name, a in abstract.items():
            if a.dtype == jnp.bool_:
                values[name] = rng.random(a.shape) < _MASK_DENSITY
            else:
                values[name] = np.asarray(values[name])
        if self.fill is not None:
            values.update(self.fill(values, rng))
        out: dict[str, Any] = dict(self.options)
        for name, a in abstract.items():
            out[name] = jnp.asarray(np.asarray(values[name]), a.dtype)
        for name, v in values.items():  # arguments ``fill`` added beyond ``arrays``
            if name not in out:
                out[name] = v
        return out


@attrs.frozen(kw_only=True)
class Invalid:
    """A change that makes an example's arguments invalid: the call must raise ValueError or
    TypeError naming the op, before any implementation runs.

    Attributes:
        name: a readable test id (``key-heads-not-dividing``).
        change: ``change(arguments) -> arguments`` applied to the op's first example (float32).
    """

    name: str
    change: Callable[[dict[str, Any]], dict[str, Any]] = attrs.field(eq=False)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def replace(cls, name: str, **values: Any) -> Invalid:
        """Arguments replaced by ``values`` (callables get the old arguments)."""

        def change(args: dict[str, Any]) -> dict[str, Any]:
            new = {k: (v(args) if callable(v) else v) for k, v in values.items()}
            return {**args, **new}

        return cls(name=name, change=change)

    @classmethod
    def extra_axis(cls, arg: str) -> Invalid:
        """``arg`` with one more (leading) axis than the op accepts."""
        return cls(name=f"{arg}-extra-axis", change=lambda a: {**a, arg: a[arg][None]})

    @classmethod
    def drop(cls, arg: str) -> Invalid:
        """A required ``arg`` left out."""
        return cls(name=f"{arg}-missing", change=lambda a: {k: v for k, v in a.items() if k != arg})


def _generic_invalid(spec: OpSpec) -> list[Invalid]:
    """Changes every op must reject: an unknown argument, a required one missing, a list
    where an array belongs."""
    cases = [Invalid.replace("unexpected-argument", not_an_argument_of_this_op=1)]
    required = [a for a in spec.args if a.required]
    if required:
        cases.append(Invalid.drop(required[0].name))
    arrays = [a for a in required if a.array]
    if arrays:
        name = arrays[0].name
        cases.append(
            Invalid.replace(
                f"{name}-not-an-array", **{name: lambda a: np.asarray(a[name]).tolist()}
            )
        )
    return cases


def _declared(spec: OpSpec) -> Sequence[Any]:
    source = spec.examples
    if source is None:
        return ()
    fn = resolve(source)
    return tuple(fn() if callable(fn) else fn)


def examples_of(spec: OpSpec, *, thorough: bool = False) -> list[Example]:
    """The op's examples (``thorough`` ones too when asked), in declaration order."""
    return [e for e in _declared(spec) if isinstance(e, Example) and (thorough or not e.thorough)]


def invalid_cases_of(spec: OpSpec) -> list[Invalid]:
    """The kit's generic invalid changes, then the op's own."""
    own = [e for e in _declared(spec) if isinstance(e, Invalid)]
    return [*_generic_invalid(spec), *own]
