"""Launching Triton kernels from JAX: jax-triton on a GPU, Triton's interpreter on a CPU.

:func:`launch` takes a ``@triton.jit`` kernel and JAX arrays. On a GPU it is a
``jax_triton.triton_call``. With ``EJKERNEL_INTERPRET=1`` on a CPU it is a host callback that
runs the *same kernel source* through Triton's interpreter: the kernel's module is imported a
second time with the interpreter switched on (so its ``@triton.jit`` helpers are interpreted
too), and NumPy buffers are handed to it through :class:`_HostTensor`, a stand-in for the few
tensor methods the interpreter calls (no PyTorch needed).

Kernel signatures follow jax-triton's convention: the inputs (arrays and scalars, in order),
then one pointer per output, then the ``tl.constexpr`` parameters by keyword.

:func:`fold_vmap` gives a launching function a batching rule (jax-triton has none): vmapped
axes fold into the kernel's batch axis.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel import env

__all__ = ["fold_vmap", "interpreting", "launch", "pow2"]

_interpreted_modules: dict[str, Any] = {}
_interpret_lock = threading.RLock()
#: The launch the interpreter is running: the kernel's name and the [start, end) byte ranges
#: of the buffers it was handed (:func:`_guard_memory` checks every access against them).
_launch_state: dict[str, Any] = {"kernel": None, "starts": None, "ends": None}


def pow2(n: int) -> int:
    """The power-of-two block (at least 16, a tensor core's smallest tile) that covers a
    dimension of ``n``."""
    return max(16, 1 << (int(n) - 1).bit_length())


def interpreting() -> bool:
    """Whether kernels run through the interpreter: asked for, and no GPU is the default device."""
    return env.interpret() and jax.default_backend() == "cpu"


def launch(
    kernel: Any,
    *args: Any,
    out_shape: Sequence[jax.ShapeDtypeStruct],
    grid: tuple[int, ...],
    num_warps: int,
    num_stages: int,
    zeroed_outputs: Sequence[int] = (),
    input_output_aliases: Mapping[int, int] | None = None,
    **constexprs: Any,
) -> list[jax.Array]:
    """Run ``kernel`` over ``grid``; return its outputs (a list, one per ``out_shape``).

    Args:
        kernel: a ``@triton.jit`` function.
        *args: JAX arrays (contiguous, row-major) and scalars, in the kernel's order: ints,
            and floats as ``np.float32`` (jax-triton passes a Python float as fp64).
        out_shape: shapes and dtypes of the outputs, whose pointers follow the inputs.
        grid: the launch grid (up to three ints).
        num_warps: warps per program.
        num_stages: software-pipelining stages.
        zeroed_outputs: indices of outputs set to zero before the launch (others start
            undefined; the interpreter fills them with NaN or -1 so unwritten parts show).
        input_output_aliases: ``{array input index: output index}`` (inputs counted among
            the array arguments only, as jax-triton counts them): the output is the input's
            buffer, which the kernel updates in place (XLA copies the input first unless it
            is donated). The interpreter starts such an output as a copy of the input.
        **constexprs: the kernel's ``tl.constexpr`` arguments.
    """
    out_shape = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
    if interpreting():
        aliases = dict(input_output_aliases or {})
        return _interpret(kernel, args, out_shape, grid, tuple(zeroed_outputs), constexprs, aliases)
    import jax_triton

    from ejkernel_triton import _kernel_cache

    _kernel_cache.install()
    outs = jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=out_shape,
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        zeroed_outputs=tuple(zeroed_outputs),
        input_output_aliases=dict(input_output_aliases or {}),
        **constexprs,
    )
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


# -- the interpreter path -------------------------------------------------------------------


def _interpreted(kernel: Any) -> Any:
    """The interpreted twin of a ``@triton.jit`` kernel: its module imported with the
    interpreter on, under a private name (the GPU module object is left untouched)."""
    import triton

    module_name = kernel.fn.__module__
    with _interpret_lock:
        module = _interpreted_modules.get(module_name)
        if module is None:
            _interpret_standard_library()
            source = sys.modules[module_name].__spec__
            spec = importlib.util.spec_from_file_location(
                f"_ejkernel_interpreted.{module_name}", source.origin
            )
            module = importlib.util.module_from_spec(spec)
            previous = triton.knobs.runtime.interpret
            triton.knobs.runtime.interpret = True
            try:
                spec.loader.exec_module(module)
            finally:
                triton.knobs.runtime.interpret = previous
            _interpreted_modules[module_name] = module
            _interpret_imported_helpers(module)
    return getattr(module, kernel.fn.__name__)


def _interpret_imported_helpers(module: Any) -> None:
    """Point the ``@triton.jit`` helpers ``module`` imported from other kernel modules of this
    package (``from ejkernel_triton.kernels.flash_attention_common import _visible``) at their
    interpreted twins: an interpreted kernel cannot call a compiled helper."""
    for name, value in list(vars(module).items()):
        fn = getattr(value, "fn", None)
        origin = getattr(fn, "__module__", "")
        if (
            origin.startswith("ejkernel_triton.")
            and origin != module.__name__.removeprefix("_ejkernel_interpreted.")
            and isinstance(getattr(value, "src", None), str)
        ):
            setattr(module, name, _interpreted(value))


def _interpret_standard_library() -> None:
    """Make ``triton.language``'s own ``@jit`` functions (``tl.zeros``, ``tl.max``, ...)
    interpretable, as they are when ``TRITON_INTERPRET=1`` is set before triton is imported.

    Only reached when interpreting, i.e. with no GPU in the process, so nothing compiles them.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # gluon wraps the originals at its import, which argument mangling triggers later
    with contextlib.suppress(ImportError):
        import triton.experimental.gluon  # noqa: F401

    for module in (tl, tl.standard, tl.math, tl.core):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, name, InterpretedFunction(value.fn))
    _index_scalars_with_item()
    _guard_memory()


class OutOfBoundsAccess(IndexError):
    """An interpreted kernel read or wrote memory outside every buffer of its launch."""


def _check_addresses(op: str, ptrs: Any, mask: Any, itemsize: int) -> None:
    """Raise :class:`OutOfBoundsAccess` when an active lane of ``ptrs`` addresses bytes outside
    the buffers of the running launch. On a GPU such a lane reads another allocation's bytes or
    faults; in the interpreter it reads the host's heap, or crashes the process."""
    starts, ends = _launch_state["starts"], _launch_state["ends"]
    if starts is None:
        return
    addresses = np.asarray(ptrs, dtype=np.uint64)
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            return
        if not mask.all():
            addresses = addresses[np.broadcast_to(mask, addresses.shape)]
    if addresses.size == 0:
        return
    low, high = addresses.min(), addresses.max()
    first = int(np.searchsorted(starts, low, side="right")) - 1
    if first >= 0 and high + np.uint64(itemsize) <= ends[first]:
        return  # every lane inside one buffer (the usual case)
    addresses = addresses.reshape(-1)
    slot = np.searchsorted(starts, addresses, side="right") - 1
    inside = (slot >= 0) & (addresses + np.uint64(itemsize) <= ends[np.maximum(slot, 0)])
    if not inside.all():
        first = int(np.argmin(inside))
        raise OutOfBoundsAccess(
            f"{_launch_state['kernel']}: {op} of {int((~inside).sum())} active lane(s) outside "
            f"every buffer of the launch (first at address {int(addresses[first]):#x}; "
            f"buffers {[(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]})"
        )


def _guard_memory() -> None:
    """Check every load, store and atomic of interpreted kernels against their launch's
    buffers (:func:`_check_addresses`), so an out-of-bounds lane fails the call that made it."""
    from triton.runtime.interpreter import InterpreterBuilder, _get_np_dtype

    if getattr(InterpreterBuilder, "_ejkernel_guarded", False):
        return
    load = InterpreterBuilder.create_masked_load
    store = InterpreterBuilder.create_masked_store
    rmw = InterpreterBuilder.create_atomic_rmw
    cas = InterpreterBuilder.create_atomic_cas

    def masked_load(self, ptrs, mask, other, *rest, **options):  # type: ignore[no-untyped-def]
        size = np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize
        _check_addresses("load", ptrs.data, mask.data, size)
        return load(self, ptrs, mask, other, *rest, **options)

    def masked_store(self, ptrs, value, mask, *rest, **options):  # type: ignore[no-untyped-def]
        _check_addresses("store", ptrs.data, mask.data, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *rest, **options)

    def atomic_rmw(self, op, ptr, val, mask, *rest, **options):  # type: ignore[no-untyped-def]
        _check_addresses("atomic", ptr.data, mask.data, val.data.dtype.itemsize)
        return rmw(self, op, ptr, val, mask, *rest, **options)

    def atomic_cas(self, ptr, cmp, val, *rest, **options):  # type: ignore[no-untyped-def]
        _check_addresses("atomic", ptr.data, None, val.data.dtype.itemsize)
        return cas(self, ptr, cmp, val, *rest, **options)

    InterpreterBuilder.create_masked_load = masked_load
    InterpreterBuilder.create_masked_store = masked_store
    InterpreterBuilder.create_atomic_rmw = atomic_rmw
    InterpreterBuilder.create_atomic_cas = atomic_cas
    InterpreterBuilder._ejkernel_guarded = True


def _index_scalars_with_item() -> None:
    """Scalars are 1-element arrays in the interpreter, which ``int()`` refuses from NumPy 2.4
    on (a loop ``range(lo, hi)`` over kernel scalars needs it): index them through ``.item()``."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ejkernel", False):
        return

    def patch(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._ejkernel = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


class _DType:
    """A dtype as the interpreter reads it: ``str()`` gives a torch-style name."""

    def __init__(self, dtype: np.dtype) -> None:
        self.name = np.dtype(dtype).name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


_DTYPES: dict[str, _DType] = {}


def _dtype(dtype: np.dtype) -> _DType:
    """One long-lived :class:`_DType` per dtype: Triton caches argument types by the dtype
    object's identity, so a freed one whose address is reused would be read as another type."""
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        _DTYPES[name] = _DType(dtype)
    return _DTYPES[name]


class _HostTensor:
    """A NumPy buffer wearing the handful of tensor methods Triton's interpreter calls.

    The interpreter reads and writes memory through ``data_ptr()``; its "copy to host and
    back" steps are no-ops here, since the buffer already lives on the host.
    """

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.dtype = _dtype(array.dtype)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def untyped_storage(self) -> _HostTensor:
        return self

    def cpu(self) -> _HostTensor:
        return self

    def new_empty(self, *args: Any, **kwargs: Any) -> _HostTensor:
        return _HostTensor(self.array)

    def set_(self, *args: Any) -> _HostTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other: Any) -> None:
        del other


def _poisoned(shape: jax.ShapeDtypeStruct, zeroed: bool) -> np.ndarray:
    out = np.empty(shape.shape, shape.dtype)
    if zeroed:
        out[...] = 0
    elif jnp.issubdtype(shape.dtype, jnp.floating):
        out[...] = np.nan
    else:
        out[...] = -1
    return out


def _scalar(x: Any) -> Any:
    """Python scalars for the interpreter (``np.float32`` is how jax-triton is told fp32)."""
    return x.item() if isinstance(x, np.generic) else x


def _interpret(
    kernel: Any,
    args: tuple[Any, ...],
    out_shape: list[jax.ShapeDtypeStruct],
    grid: tuple[int, ...],
    zeroed: tuple[int, ...],
    constexprs: dict[str, Any],
    aliases: dict[int, int],
) -> list[jax.Array]:
    is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in args]
    # Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns: hand it
    # float32 copies and round the results back (the GPU path computes in bfloat16 proper)
    arrays = [_widen(a) for a, arr in zip(args, is_array, strict=True) if arr]
    wanted = out_shape
    out_shape = [jax.ShapeDtypeStruct(s.shape, _wide(s.dtype)) for s in out_shape]
    interpreted = _interpreted(kernel)

    def host(*buffers: np.ndarray) -> list[np.ndarray]:
        it = iter(buffers)
        call_args = [
            _HostTensor(np.array(next(it), order="C", copy=True)) if arr else _scalar(a)
            for a, arr in zip(args, is_array, strict=True)
        ]
        outs = [_poisoned(s, i in zeroed) for i, s in enumerate(out_shape)]
        for source, target in aliases.items():
            outs[target] = np.array(buffers[source], dtype=out_shape[target].dtype, copy=True)
        # the interpreter keeps global state (the grid position, patched language modules)
        # and XLA may run independent callbacks at once: one interpreted launch at a time
        tensors = [*(a for a in call_args if isinstance(a, _HostTensor)), *map(_HostTensor, outs)]
        ranges = sorted((t.data_ptr(), t.data_ptr() + t.array.nbytes) for t in tensors)
        with _interpret_lock:
            _launch_state.update(
                kernel=getattr(kernel, "__name__", None) or kernel.fn.__name__,
                starts=np.array([a for a, _ in ranges], np.uint64),
                ends=np.array([b for _, b in ranges], np.uint64),
            )
            try:
                interpreted[grid](*call_args, *(_HostTensor(o) for o in outs), **constexprs)
            finally:
                _launch_state.update(kernel=None, starts=None, ends=None)
        return outs

    outs = jax.pure_callback(host, out_shape, *arrays, vmap_method="sequential")
    return [o.astype(w.dtype) for o, w in zip(outs, wanted, strict=True)]


def _wide(dtype: Any) -> Any:
    return jnp.float32 if dtype == jnp.bfloat16 else dtype


def _widen(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x


# -- batching -------------------------------------------------------------------------------

#: How :func:`fold_vmap` treats each argument: its leading axis is the batch (``"batch"``);
#: it is the batch or 1, read with a zero stride when 1 (``"broadcast"``); or it has no batch
#: axis, so a vmapped one cannot fold and the calls run one after another (``"other"``).
BATCH, BROADCAST, OTHER = "batch", "broadcast", "other"


def fold_vmap(fn: Callable[..., Any], modes: Sequence[str]) -> Callable[..., Any]:
    """``fn(*arrays) -> tuple of arrays``, outputs batch-leading, made vmappable.

    Under ``vmap``, a mapped axis of size V on the arguments is folded into their leading
    batch axis (``[V, B, ...] -> [V·B, ...]``), the kernel runs once, and the outputs are
    unfolded. Unmapped batch arguments are repeated V times; unmapped broadcast arguments of
    leading size 1 stay as they are. A mapped ``"other"`` argument falls back to a sequential
    ``lax.map`` over V.
    """
    batched_fn = jax.custom_batching.custom_vmap(fn)

    @batched_fn.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *args: Any) -> Any:
        if any(b and m == OTHER for b, m in zip(in_batched, modes, strict=True)):
            outs = jax.lax.map(
                lambda i: fn(*(a[i] if b else a for a, b in zip(args, in_batched, strict=True))),
                jnp.arange(axis_size),
            )
            return outs, jax.tree.map(lambda _: True, outs)
        batch = next(
            a.shape[1] if b else a.shape[0]
            for a, b, m in zip(args, in_batched, modes, strict=True)
            if m == BATCH
        )
        folded = [
            _fold(a, b, m, axis_size, batch)
            for a, b, m in zip(args, in_batched, modes, strict=True)
        ]
        outs = fn(*folded)
        # batch-leading outputs unfold; others (placeholders) are the same for every index
        unfolds = jax.tree.map(lambda o: o.ndim > 0 and o.shape[0] == axis_size * batch, outs)
        outs = jax.tree.map(
            lambda o, u: o.reshape(axis_size, batch, *o.shape[1:]) if u else o, outs, unfolds
        )
        return outs, unfolds

    return batched_fn


def _fold(a: jax.Array, batched: bool, mode: str, size: int, batch: int) -> jax.Array:
    if mode == OTHER:
        return a
    if not batched:
        if mode == BROADCAST and a.shape[0] == 1:
            return a
        a = jnp.broadcast_to(a[None], (size, *a.shape))
    a = jnp.broadcast_to(a, (size, batch, *a.shape[2:]))
    return a.reshape(size * batch, *a.shape[2:])
