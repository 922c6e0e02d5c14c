"""Recording op invocations: which calls a program makes, by their abstract arguments.

Recording is on while ``EJKERNEL_OPS_RECORD=1`` (read at every call) or inside
``with record_invocations() as rec:`` (a context variable: other threads and tasks are not
recorded by it). Every op call that goes through the executor is then kept as a
:class:`~ejkernel._records.RecordedInvocation`, deduplicated by
:meth:`~ejkernel._records.RecordedInvocation.dedupe_key`: eager calls when they run, calls
under ``jax.jit``, ``grad``, ``vmap``... when they are traced (the differentiated call, whose
config is chosen separately, with ``grad=True``). A function ``jax.jit`` already traced is not
traced again, so its calls are recorded only if recording was on when it was first traced.

Records go to the process-wide list (:func:`get_invocations`) and to every enclosing
``record_invocations()`` block. :func:`save_invocations` and :func:`load_invocations` carry
them to another process (``ejkernel-invocations/1`` JSON), where batch tuning reads them.

User :class:`ejkernel.ops.Kernel` calls are recorded too: positional arguments under the names
``"0"``, ``"1"``, ... (:func:`call_arguments` rebuilds the call) and the kernel object in
``RecordedInvocation.kernel``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from ejkernel import _env
from ejkernel._invocation import Invocation, _is_array
from ejkernel._records import RecordedInvocation, dumps, loads

__all__ = [
    "InvocationRecorder",
    "active",
    "call_arguments",
    "clear_invocations",
    "get_invocations",
    "load_invocations",
    "record",
    "record_invocation",
    "record_invocations",
    "record_kernel_call",
    "record_op_call",
    "save_invocations",
]


class InvocationRecorder:
    """The records of one ``record_invocations()`` block (or of the process), deduplicated,
    in first-seen order. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, RecordedInvocation] = {}

    def add(self, record: RecordedInvocation) -> bool:
        """Keep ``record`` unless an equal one is kept; returns whether it was new."""
        key = record.dedupe_key()
        with self._lock:
            if key in self._records:
                return False
            self._records[key] = record
            return True

    @property
    def invocations(self) -> list[RecordedInvocation]:
        """The records, in first-seen order."""
        with self._lock:
            return list(self._records.values())

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the records to ``path`` (see :func:`save_invocations`)."""
        return save_invocations(path, self.invocations)

    def __iter__(self) -> Iterator[RecordedInvocation]:
        return iter(self.invocations)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"InvocationRecorder({len(self)} invocations)"


_process = InvocationRecorder()
_blocks: contextvars.ContextVar[tuple[InvocationRecorder, ...]] = contextvars.ContextVar(
    "ejkernel_recorders", default=()
)


def active() -> bool:
    """Whether calls are recorded here and now (a context variable, then the environment)."""
    if _blocks.get():
        return True
    return bool(os.environ.get(_env.OPS_RECORD)) and _env.ops_record()


@contextlib.contextmanager
def record_invocations() -> Iterator[InvocationRecorder]:
    """Record every op call made in this block (this thread or task only).

    Yields:
        The block's :class:`InvocationRecorder` (``rec.invocations``, ``list(rec)``,
        ``rec.save(path)``); the records also go to :func:`get_invocations`.

    Example:
        >>> with record_invocations() as rec:  # doctest: +SKIP
        ...     jax.jit(step).lower(params, batch)  # tracing is enough
        >>> save_invocations("calls.json", rec.invocations)  # doctest: +SKIP
    """
    recorder = InvocationRecorder()
    token = _blocks.set((*_blocks.get(), recorder))
    try:
        yield recorder
    finally:
        _blocks.reset(token)


def record(rec: RecordedInvocation) -> RecordedInvocation:
    """Add a record to the process-wide list and every enclosing block."""
    _process.add(rec)
    for block in _blocks.get():
        block.add(rec)
    return rec


def get_invocations() -> list[RecordedInvocation]:
    """Every invocation recorded in this process, deduplicated, in first-seen order."""
    return _process.invocations


def clear_invocations() -> None:
    """Forget the process-wide records (blocks keep theirs)."""
    _process.clear()


# -- what the executor calls --------------------------------------------------------------------


def record_op_call(
    spec: Any, arguments: Mapping[str, Any], *, platform: str | None, grad: bool
) -> None:
    """Record a call of the op ``spec`` on its validated arguments."""
    array_names = [a.name for a in spec.args if a.array]
    record(
        RecordedInvocation.from_arguments(
            spec.name, arguments, array_names, platform=platform, grad=grad
        )
    )


def _positional(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {**{str(i): a for i, a in enumerate(args)}, **kwargs}


def record_kernel_call(
    kernel: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, grad: bool
) -> None:
    """Record a call of a user :class:`ejkernel.ops.Kernel`."""
    arguments = _positional(args, kwargs)
    rec = RecordedInvocation.from_arguments(
        kernel.name, arguments, [k for k, v in arguments.items() if _is_array(v)], grad=grad
    )
    record(_with_kernel(rec, kernel))


def _with_kernel(rec: RecordedInvocation, kernel: Any) -> RecordedInvocation:
    return attrs.evolve(rec, kernel=kernel)


def call_arguments(rec: RecordedInvocation) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call the recorded op or kernel with (arrays as
    ``jax.ShapeDtypeStruct``): a user kernel's positional arguments in order; an op's every
    argument by name.

    Raises:
        ValueError: a static argument of the record cannot be rebuilt (see ``opaque``).
    """
    arguments = rec.arguments()
    positions = sorted(int(k) for k in arguments if k.isdigit())
    args = tuple(arguments.pop(str(i)) for i in positions)
    return args, arguments


# -- recording by hand ------------------------------------------------------------------------


def _resolve_kernel(kernel: Any) -> tuple[Any | None, Any | None]:
    """``(op spec, user kernel)``: exactly one is not None."""
    from ejkernel._kernel import Kernel, OpKernel
    from ejkernel.plugins import get_registry

    if isinstance(kernel, OpKernel):
        return kernel.spec, None
    if isinstance(kernel, Kernel):
        return None, kernel
    name = kernel if isinstance(kernel, str) else getattr(kernel, "__name__", None)
    if isinstance(name, str):
        try:
            return get_registry().spec(name), None
        except Exception as err:
            raise ValueError(f"record_invocation: `kernel` {name!r} is not a known op") from err
    raise TypeError(
        "record_invocation: `kernel` must be an op kernel (ejkernel.modules.FlashAttention()), "
        f"an op name or an ejkernel.ops.Kernel; got {type(kernel).__name__}"
    )


def record_invocation(kernel: Any, inv: Invocation | RecordedInvocation) -> RecordedInvocation:
    """Add an invocation to the records by hand (whether or not recording is on).

    Args:
        kernel: an op kernel (``ejkernel.modules.FlashAttention()``), an op name or public
            function, or a user :class:`ejkernel.ops.Kernel`.
        inv: an :class:`ejkernel.ops.Invocation` (arrays may be ``jax.ShapeDtypeStruct``;
            ``metadata={"grad": True}`` records the differentiated call, ``platform=`` among
            an op's keyword arguments or in ``metadata`` a forced platform), or a
            :class:`~ejkernel._records.RecordedInvocation`.

    Returns:
        The record kept.

    Raises:
        TypeError, ValueError: ``kernel`` or ``inv`` is not one of the above, ``inv`` is of
            another op, or its arguments do not validate for the op.
    """
    spec, user = _resolve_kernel(kernel)
    name = spec.name if spec is not None else user.name
    if isinstance(inv, RecordedInvocation):
        if inv.op != name:
            raise ValueError(f"record_invocation: `inv` records op {inv.op!r}, not {name!r}")
        return record(_with_kernel(inv, user) if user is not None else inv)
    if not isinstance(inv, Invocation):
        raise TypeError(
            "record_invocation: `inv` must be an ejkernel.ops.Invocation or a "
            f"RecordedInvocation; got {type(inv).__name__}"
        )
    platform = inv.metadata.get("platform")
    if user is not None:
        arguments = _positional(tuple(inv.args), inv.kwargs)
        rec = RecordedInvocation.from_arguments(
            name,
            arguments,
            [k for k, v in arguments.items() if _is_array(v)],
            platform=platform,
            grad=inv.grad,
        )
        return record(_with_kernel(rec, user))
    kwargs = dict(inv.kwargs)
    platform = kwargs.pop("platform", None) or platform
    cfg = kwargs.pop("cfg", None)
    if platform is None and getattr(cfg, "platform", None) not in (None, "auto"):
        platform = str(cfg.platform)
    arguments = spec.validate(spec.bind(tuple(inv.args), kwargs))
    array_names = [a.name for a in spec.args if a.array]
    return record(
        RecordedInvocation.from_arguments(
            name, arguments, array_names, platform=platform, grad=inv.grad
        )
    )


# -- files ------------------------------------------------------------------------------------


def save_invocations(
    path: str | os.PathLike[str], records: list[RecordedInvocation] | None = None
) -> Path:
    """Write records (default: :func:`get_invocations`) to a JSON file, atomically.

    Returns:
        The path written.
    """
    path = Path(path).expanduser()
    text = dumps(get_invocations() if records is None else records)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def load_invocations(path: str | os.PathLike[str]) -> list[RecordedInvocation]:
    """Read a file :func:`save_invocations` wrote (they are not added to the records).

    Raises:
        ValueError: the file is not a file of records (says which).
    """
    path = Path(path).expanduser()
    try:
        return loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
