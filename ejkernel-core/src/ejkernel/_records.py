"""Recorded invocations: one op call by its abstract arguments, portable between processes.

A :class:`RecordedInvocation` is what recording keeps of a call (op, platform if forced, whether
it was differentiated, each array's shape, dtype and sharding, each static argument's value) and
what batch tuning, shipped tables and ``ejkernel tune --shapes`` read back. It serialises to
JSON (:meth:`RecordedInvocation.to_dict`, :func:`dumps`, :func:`loads`) so one process records
and another tunes.

A static argument that JSON cannot carry (a callable, an object) is kept by its
:func:`ejkernel._invocation.static_value` text: such a record still deduplicates and keys, but
:meth:`RecordedInvocation.arguments` cannot rebuild it and says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import jax
import numpy as np

from ejkernel._invocation import abstract_value, sharding_fingerprint, static_value

__all__ = ["FORMAT", "ArraySpec", "RecordedInvocation", "dumps", "loads"]

#: The ``format`` field of a file of records.
FORMAT = "ejkernel-invocations/1"


@attrs.frozen(kw_only=True)
class ArraySpec:
    """An array argument by its abstract value.

    Attributes:
        shape: the shape.
        dtype: the dtype's name (``"bfloat16"``).
        sharding: :func:`ejkernel.ops.sharding_fingerprint` of the array, if it had one.
    """

    shape: tuple[int, ...]
    dtype: str
    sharding: str | None = None

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, np.dtype(jax.numpy.dtype(self.dtype)))


def _portable(v: Any) -> bool:
    """Whether JSON carries ``v`` back as an equal value (tuples come back as tuples)."""
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (tuple, list)):
        return all(_portable(x) for x in v)
    return False


def _static(v: Any) -> tuple[Any, bool]:
    """(JSON form, portable?) of a static argument."""
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        v = v.item()
    if _portable(v):
        return (list(v) if isinstance(v, tuple) else v), True
    return static_value(v), False


def _detuple(v: Any) -> Any:
    return tuple(_detuple(x) for x in v) if isinstance(v, list) else v


@attrs.frozen(kw_only=True)
class RecordedInvocation:
    """One op call, abstractly.

    Attributes:
        op: the op name.
        arrays: array arguments by name (absent optional arrays are not listed).
        static: static arguments by name, in JSON form (tuples as lists).
        platform: the platform the call forced (``platform=``, ``cfg.platform`` or
            ``EJKERNEL_PLATFORM``), else None.
        grad: the call was differentiated.
        opaque: names of static arguments JSON cannot carry (kept as text in ``static``).
        kernel: for a user :class:`ejkernel.ops.Kernel`, the kernel object in the process that
            recorded it, its class's ``module:qualname`` text after a JSON round trip; ``None``
            for ops of the catalogue. Not compared: records differing only here are equal.
    """

    op: str
    arrays: Mapping[str, ArraySpec] = attrs.field(factory=dict)
    static: Mapping[str, Any] = attrs.field(factory=dict)
    platform: str | None = None
    grad: bool = False
    opaque: tuple[str, ...] = ()
    kernel: Any = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def from_arguments(
        cls,
        op: str,
        arguments: Mapping[str, Any],
        array_names: Iterable[str],
        *,
        platform: str | None = None,
        grad: bool = False,
    ) -> RecordedInvocation:
        """Record a call from its validated arguments (arrays may be tracers).

        Args:
            op: the op name.
            arguments: every argument by name.
            array_names: which arguments are arrays (the spec's ``Arg.array``).
            platform: the forced platform, if any.
            grad: whether the call is differentiated.
        """
        names = set(array_names)
        arrays: dict[str, ArraySpec] = {}
        static: dict[str, Any] = {}
        opaque: list[str] = []
        for name, value in sorted(arguments.items()):
            if name in names:
                if value is None:
                    continue
                a = abstract_value(value)
                arrays[name] = ArraySpec(
                    shape=tuple(int(d) for d in a.shape),
                    dtype=str(np.dtype(a.dtype)),
                    sharding=sharding_fingerprint(value),
                )
            else:
                static[name], portable = _static(value)
                if not portable:
                    opaque.append(name)
        return cls(
            op=op,
            arrays=arrays,
            static=static,
            platform=platform,
            grad=grad,
            opaque=tuple(opaque),
        )

    def arguments(self) -> dict[str, Any]:
        """Every recorded argument: arrays as ``jax.ShapeDtypeStruct``, statics as values.

        Raises:
            ValueError: a static argument was not portable (see ``opaque``).
        """
        if self.opaque:
            raise ValueError(
                f"{self.op}: the recorded static argument(s) {', '.join(self.opaque)} cannot be "
                f"rebuilt from the record (not JSON values)"
            )
        out: dict[str, Any] = {k: _detuple(v) for k, v in self.static.items()}
        out.update({k: a.abstract() for k, a in self.arrays.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see :data:`FORMAT`)."""
        out: dict[str, Any] = {
            "op": self.op,
            "arrays": {
                k: {"shape": list(a.shape), "dtype": a.dtype}
                | ({"sharding": a.sharding} if a.sharding is not None else {})
                for k, a in self.arrays.items()
            },
            "static": dict(self.static),
            "grad": self.grad,
        }
        if self.platform is not None:
            out["platform"] = self.platform
        if self.opaque:
            out["opaque"] = list(self.opaque)
        if self.kernel is not None:
            out["kernel"] = kernel_name(self.kernel)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecordedInvocation:
        """Read :meth:`to_dict`'s form back.

        Raises:
            ValueError: ``data`` is not a record (names the field at fault).
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("op"), str):
            raise ValueError(f"an invocation record needs a string 'op'; got {data!r:.200}")
        arrays = data.get("arrays", {})
        if not isinstance(arrays, Mapping):
            raise ValueError(f"{data['op']}: 'arrays' must be an object")
        specs: dict[str, ArraySpec] = {}
        for name, a in arrays.items():
            try:
                specs[name] = ArraySpec(
                    shape=tuple(int(d) for d in a["shape"]),
                    dtype=str(a["dtype"]),
                    sharding=a.get("sharding"),
                )
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"{data['op']}: array {name!r} needs 'shape' (list of ints) and 'dtype'; "
                    f"got {a!r}"
                ) from err
        static = data.get("static", {})
        if not isinstance(static, Mapping):
            raise ValueError(f"{data['op']}: 'static' must be an object")
        return cls(
            op=data["op"],
            arrays=specs,
            static=dict(static),
            platform=data.get("platform"),
            grad=bool(data.get("grad", False)),
            opaque=tuple(data.get("opaque", ())),
            kernel=data.get("kernel"),
        )

    def dedupe_key(self) -> str:
        """Equal for records of the same call signature (what recording deduplicates by)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def kernel_name(kernel: Any) -> str:
    """``module:qualname`` of a user kernel's class (a string is returned as it is)."""
    if isinstance(kernel, str):
        return kernel
    cls = type(kernel)
    return f"{cls.__module__}:{cls.__qualname__}"


def dumps(records: Iterable[RecordedInvocation]) -> str:
    """A file's text: ``{"format": FORMAT, "invocations": [...]}``."""
    return json.dumps(
        {"format": FORMAT, "invocations": [r.to_dict() for r in records]}, indent=1, sort_keys=True
    )


def loads(text: str | bytes) -> list[RecordedInvocation]:
    """Read :func:`dumps`' text (or a bare JSON list of records).

    Raises:
        ValueError: not JSON, another format, or a malformed record.
    """
    data = json.loads(text)
    if isinstance(data, Mapping):
        if data.get("format") != FORMAT:
            raise ValueError(f"expected format {FORMAT!r}; got {data.get('format')!r}")
        data = data.get("invocations")
    if not isinstance(data, list):
        raise ValueError("expected a list of invocation records")
    return [RecordedInvocation.from_dict(d) for d in data]
