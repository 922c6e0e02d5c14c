"""What an op is: its arguments, their validation, and its plain-JAX reference."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import math
import os
import re
import typing
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import attrs
import jax
import numpy as np

from ejkernel.errors import ConfigError


@attrs.frozen(kw_only=True)
class Arg:
    """One argument of an op.

    Attributes:
        name: the OPS.md name; implementations receive it as a keyword.
        array: an array argument (may be traced; enters the cache key by shape and dtype) rather
            than a static Python value (enters the key by value).
        required: must be given (positional arguments of the public function).
        default: value when not given.
        differentiable: gradients flow to it when it is a floating array.
    """

    name: str
    array: bool
    required: bool = False
    default: Any = None
    differentiable: bool = False


#: Parameters of a public op function that steer the call (platform choice, a config) rather
#: than being arguments of the op.
CALL_PARAMETERS = ("platform", "cfg")


@attrs.frozen(kw_only=True)
class OpSpec:
    """The contract of one op, shared by every implementation.

    In-tree ops build theirs with :meth:`OpSpec.from_function` (through
    :func:`builtin_op_spec`), which reads the arguments from the public function's signature;
    ``args=`` spells them out (a spec added with ``registry.add_op`` may do either).

    Attributes:
        name: the registry key, the `ejkernel.<op>` function name.
        args: the arguments in signature order (required positional ones first).
        validate: checks and normalises the bound arguments (fills defaults such as
            ``softmax_scale``); raises ValueError/TypeError naming the argument.
        reference: the plain-JAX oracle, called with every argument as a keyword.
        differentiable: whether the op has a backward pass.
        synthetic: builds valid concrete inputs from abstract ones for autotuning (integer
            lengths and tables inside their ranges); ``None`` uses :func:`default_synthetic`.
        examples: the conformance kit's cases for this op (``examples() -> list`` of
            :class:`ejkernel.testing.Example` and :class:`ejkernel.testing.Invalid`), or a
            ``"module:attr"`` string naming that function (imported only by the kit).
            ``None``: the kit has nothing to run for this op and says so.
        tolerances: ``{dtype name: (rtol, atol)}`` entries that replace
            :data:`ejkernel.testing.TOLERANCES` for this op (long recurrences accumulate more
            rounding); ``None`` keeps the table.
        served_by: an op whose implementations also serve this one, on every platform that
            registers none of its own for it; this op's arguments must be some of that op's
            (the others run at their defaults). ``scaled_dot_product_attention`` is served by
            ``flash_attention``.
    """

    name: str
    args: tuple[Arg, ...]
    validate: Callable[[dict[str, Any]], dict[str, Any]]
    reference: Callable[..., Any]
    differentiable: bool = True
    synthetic: Callable[[Mapping[str, Any], int], dict[str, Any]] | None = None
    examples: Callable[[], Any] | str | None = None
    tolerances: Mapping[str, tuple[float, float]] | None = attrs.field(default=None, eq=False)
    served_by: str | None = None
    _by_name: dict[str, Arg] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {a.name: a for a in self.args})

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        differentiable: Collection[str] = (),
        arrays: Collection[str] | None = None,
        **fields: Any,
    ) -> OpSpec:
        """The spec of the op whose public function is ``fn``, its arguments read from ``fn``.

        Every parameter of ``fn`` but ``platform`` and ``cfg`` is an argument, in signature
        order: required when it has no default, else with that default.

        Args:
            fn: the public function, ``def x(positional..., *, keyword..., platform=None,
                cfg=None)``; its name is the op's unless ``fields`` give ``name``.
            differentiable: the arguments that get gradients (arrays). The op has a backward
                pass when any argument is differentiable.
            arrays: the array arguments; ``None`` reads them from the annotations (a parameter
                whose annotation names ``jax.Array`` is an array, any other a static).
            **fields: the other :class:`OpSpec` fields (``validate``, ``reference``, ...).
        """
        params = [
            p for p in inspect.signature(fn).parameters.values() if p.name not in CALL_PARAMETERS
        ]
        names = [p.name for p in params]
        array_names = set(_annotated_arrays(fn, names) if arrays is None else arrays)
        grads = set(differentiable)
        unknown = sorted((array_names | grads) - set(names))
        if unknown:
            raise ValueError(f"{fn.__name__}: no parameter named {unknown}")
        if grads - array_names:
            raise ValueError(f"{fn.__name__}: differentiable statics {sorted(grads - array_names)}")
        args = tuple(
            Arg(
                name=p.name,
                array=p.name in array_names,
                required=p.default is inspect.Parameter.empty,
                default=None if p.default is inspect.Parameter.empty else p.default,
                differentiable=p.name in grads,
            )
            for p in params
        )
        fields.setdefault("name", fn.__name__)
        fields.setdefault("differentiable", bool(grads))
        return cls(args=args, **fields)

    def arg(self, name: str) -> Arg:
        return self._by_name[name]

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Bind positional and keyword arguments to names, with defaults; unknown names raise."""
        names = self.arg_names
        if len(args) > len(names):
            raise TypeError(f"{self.name}: takes at most {len(names)} arguments; got {len(args)}")
        bound: dict[str, Any] = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{self.name}: unexpected argument `{k}`")
            if k in bound:
                raise TypeError(f"{self.name}: got `{k}` twice")
            bound[k] = v
        for a in self.args:
            if a.name not in bound:
                if a.required:
                    raise TypeError(f"{self.name}: missing required argument `{a.name}`")
                bound[a.name] = a.default
        return bound

    def abstract_output(self, arguments: Mapping[str, Any]) -> Any:
        """Shapes and dtypes of the output, without computing it."""
        return jax.eval_shape(lambda kw: self.reference(**kw), dict(arguments))

    def make_synthetic(self, abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
        fn = self.synthetic or default_synthetic
        return fn(abstract, seed)


#: The ``tolerances`` of the ops whose implementations chunk a recurrence: regrouping its sums
#: holds float32 to 1e-4 relative.
CHUNKED_TOLERANCES: Mapping[str, tuple[float, float]] = {"float32": (1e-4, 1e-4)}


def jit_over_arrays(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one jitted program per set of non-array arguments: the array arguments are
    traced, every other argument is static: a reference called eagerly (as tests do) would
    otherwise compile each of its operations on its own. An unhashable non-array argument runs
    ``fn`` op by op."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        arrays = {k: v for k, v in arguments.items() if isinstance(v, jax.Array | np.ndarray)}
        try:
            jitted = jitted_with_statics(
                fn, static_key(arguments.keys() - arrays.keys(), arguments)
            )
        except TypeError:
            return fn(*args, **kwargs)
        return jitted(arrays)

    return run


def static_key(names: Iterable[str], values: Mapping[str, Any]) -> tuple[Any, ...]:
    """The cache key of the static arguments ``names`` of ``values`` (``TypeError`` when one
    is unhashable); each value's type is part of it, so ``1``, ``1.0`` and ``True`` stay
    apart."""
    key = tuple(sorted((k, type(values[k]).__name__, values[k]) for k in names))
    hash(key)
    return key


@functools.lru_cache(maxsize=1024)
def jitted_with_statics(fn: Callable[..., Any], key: tuple[Any, ...]) -> Any:
    """``arrays -> fn(**statics, **arrays)`` jitted, the statics those of :func:`static_key`'s
    ``key``: one function, so one compile a set of shapes, for every call with them."""
    statics = {k: v for k, _, v in key}
    return jax.jit(lambda arrays: fn(**statics, **arrays))


def builtin_op_spec(fn: Callable[..., Any], **fields: Any) -> OpSpec:
    """:meth:`OpSpec.from_function` for an op that ships with core, laid out by the finding
    rule: ``validate`` and ``reference`` default to ``validate_<op>`` and ``<op>_reference`` of
    ``fn``'s module, ``examples`` to ``ejkernel.testing.cases.<op>:examples``. ``fields`` give
    the other fields, or other values for these."""
    name = fields.get("name", fn.__name__)
    module = inspect.getmodule(fn)
    if "validate" not in fields:
        fields["validate"] = getattr(module, f"validate_{name}")
    if "reference" not in fields:
        fields["reference"] = getattr(module, f"{name}_reference")
    fields.setdefault("examples", f"ejkernel.testing.cases.{name}:examples")
    return OpSpec.from_function(fn, **fields)


def _annotated_arrays(fn: Callable[..., Any], names: list[str]) -> list[str]:
    """The parameters of ``fn`` annotated as ``jax.Array`` (alone or in a union)."""
    hints = typing.get_type_hints(fn)
    missing = [n for n in names if n not in hints]
    if missing:
        raise TypeError(f"{fn.__name__}: annotate {missing} or pass `arrays=`")
    return [n for n in names if hints[n] is jax.Array or jax.Array in typing.get_args(hints[n])]


def call_op(spec: OpSpec, arguments: dict[str, Any]) -> Any:
    """Run an op through the default executor (imported lazily: ``import ejkernel`` stays light)."""
    from ejkernel._executor import call_op as run

    empty = empty_output(spec, arguments)
    if empty is not None:
        return empty
    return run(spec, arguments)


def empty_output(spec: OpSpec, arguments: Mapping[str, Any]) -> Any:
    """The op's output when its (first) output has no elements (a batch of 0), else None.

    An empty output needs no kernel, so no platform is asked to serve it (several cannot
    launch an empty grid): it is zeros, or the reference's result when other outputs are not
    empty (``ragged_page_attention_v3`` returns its caches, written with no tokens). The
    arguments (``platform=`` and the kind of ``cfg=`` too) are still validated. Only calls
    with an empty array argument pay for the check (the op's ``validate`` and an
    ``eval_shape`` of its reference).
    """
    if not any(getattr(arguments.get(a.name), "size", 1) == 0 for a in spec.args if a.array):
        return None
    from ejkernel._selection import check_platform_argument

    bound = {k: v for k, v in arguments.items() if k not in CALL_PARAMETERS}
    checked = spec.validate(dict(bound))
    check_platform_argument(spec, arguments.get("platform"))
    cfg = arguments.get("cfg")
    if cfg is not None and not (attrs.has(type(cfg)) or dataclasses.is_dataclass(cfg)):
        raise ConfigError(f"{spec.name}: `cfg` must be a config or None; got {type(cfg).__name__}")
    arrays = {k: v for k, v in checked.items() if spec.arg(k).array and v is not None}
    statics = {k: v for k, v in checked.items() if k not in arrays}
    shapes = jax.eval_shape(lambda arr: spec.reference(**arr, **statics), arrays)
    leaves = jax.tree.leaves(shapes)
    if not leaves or leaves[0].size:
        return None
    if any(leaf.size for leaf in leaves):
        return spec.reference(**arrays, **statics)
    return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)


#: Arrays of at least this many elements are drawn in slices, one generator each, on several
#: threads (NumPy's generators release the GIL while they fill): the three 2²⁵-element inputs
#: of an attention call take seconds on one thread, which batch tuning pays per shape.
PARALLEL_DRAW = 1 << 22
_DRAW_SLICES = 16


def normal_draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Standard normal values of ``shape`` in ``dtype``, drawn from ``rng`` (float32 draws).

    Below :data:`PARALLEL_DRAW` elements one draw from ``rng``; above it, ``rng`` spawns one
    generator per slice of the flattened array and the slices fill in parallel threads. The
    values depend only on ``rng``'s state, never on the number of threads."""
    size = math.prod(shape)
    if size < PARALLEL_DRAW:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    out = np.empty(size, dtype)
    edges = np.linspace(0, size, _DRAW_SLICES + 1).astype(np.int64)
    generators = rng.spawn(_DRAW_SLICES)

    def fill(i: int) -> None:
        lo, hi = edges[i], edges[i + 1]
        out[lo:hi] = generators[i].standard_normal(hi - lo, dtype=np.float32)

    workers = min(_DRAW_SLICES, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ejkernel-draw") as pool:
        list(pool.map(fill, range(_DRAW_SLICES)))
    return out.reshape(shape)


def default_synthetic(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Concrete stand-ins: normal floats, all-True booleans, zero integers; statics unchanged.

    Built with NumPy, so it is safe to call while a JAX trace is active."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, value in abstract.items():
        if isinstance(value, jax.ShapeDtypeStruct):
            dtype = np.dtype(value.dtype)
            if dtype == np.bool_:
                out[name] = np.ones(value.shape, dtype)
            elif np.issubdtype(dtype, np.integer):
                out[name] = np.zeros(value.shape, dtype)
            else:
                out[name] = normal_draw(rng, value.shape, dtype)
        else:
            out[name] = value
    return out


def synthetic_normals(
    abstract: Mapping[str, Any],
    seed: int,
    adjust: Mapping[str, Callable[[np.ndarray], np.ndarray]],
) -> dict[str, Any]:
    """Concrete inputs from standard normal float32 draws, one per array in order;
    ``adjust[name](normal)`` turns the draw of an array named there into a valid value of that
    argument (a decay, offsets); the other arrays keep their draws. Statics pass unchanged."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, value in abstract.items():
        if isinstance(value, jax.ShapeDtypeStruct):
            normal = normal_draw(rng, value.shape, np.float32)
            if name in adjust:
                normal = adjust[name](normal)
            out[name] = jax.numpy.asarray(normal, value.dtype)
        else:
            out[name] = value
    return out


def even_offsets(total: int, n: int) -> np.ndarray:
    """``[n + 1]`` offsets cutting ``total`` tokens into n nearly equal packed sequences."""
    return np.linspace(0, total, n + 1).round()


def letter_shape(letters: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape that OPS.md ``letters`` spell with ``sizes`` (letter -> size):
    ``"[B, S, I]"`` is ``(sizes["B"], sizes["S"], sizes["I"])``."""
    return tuple(sizes[letter] for letter in re.findall(r"\w+", letters))


def even_cu_seqlens(abstract: Mapping[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    """The :func:`synthetic_normals` transform of ``cu_seqlens`` ``[N + 1]``: offsets cutting
    the query's tokens into N nearly equal packed sequences."""
    return lambda normal: even_offsets(abstract["query"].shape[1], normal.shape[0] - 1)


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def check_array(op: str, name: str, x: Any, *, ndim: int | tuple[int, ...], letters: str) -> None:
    """Raise TypeError/ValueError unless ``x`` is an array of ``ndim`` dims."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: `{name}` must be an array {letters}; got {type(x).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in dims:
        raise ValueError(f"{op}: `{name}` must be {letters}; got {name}.shape={tuple(x.shape)}")


def check_floating(op: str, named: Iterable[tuple[str, Any]]) -> None:
    """Raise TypeError unless every ``(name, array)`` has a floating dtype."""
    for name, x in named:
        if not is_floating(x):
            raise TypeError(f"{op}: `{name}` must be a floating array; got dtype {x.dtype}")


def check_qkv(
    op: str, q: Any, k: Any, v: Any, *, letters: tuple[str, str, str], query_ndim: int = 4
) -> None:
    """``query``, ``key`` and ``value``: floating arrays of one dtype, shaped as ``letters``
    (OPS.md letters; ``key`` and ``value`` 4-d, ``query`` ``query_ndim``-d).

    Only ranks are checked here; how the sizes relate is the op's to say."""
    named = (("query", q), ("key", k), ("value", v))
    for (name, x), spelled, ndim in zip(named, letters, (query_ndim, 4, 4)):
        check_array(op, name, x, ndim=ndim, letters=spelled)
    check_floating(op, named)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{op}: `query`, `key` and `value` must share one dtype; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )


def check_cu_seqlens(op: str, cu: Any) -> int:
    """``cu_seqlens``: integer offsets ``[N + 1]`` of N >= 1 packed sequences; returns N."""
    check_array(op, "cu_seqlens", cu, ndim=1, letters="[N + 1]")
    if not is_integer(cu):
        raise TypeError(f"{op}: `cu_seqlens` must be an integer array; got dtype {cu.dtype}")
    if cu.shape[0] < 2:
        raise ValueError(
            f"{op}: `cu_seqlens` must be [N + 1] with N >= 1 sequences; got "
            f"cu_seqlens.shape={tuple(cu.shape)}"
        )
    return int(cu.shape[0]) - 1


def check_flag(op: str, name: str, value: Any) -> bool:
    """A static bool (NumPy's included), as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: `{name}` must be a bool; got {value!r}")
    return bool(value)


def static_number(op: str, name: str, x: Any) -> float:
    """A static Python number (a concrete 0-d array is accepted; a tracer is not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"{op}: `{name}` must be a Python number (it is static, part of the compiled "
                f"kernel); got a traced value"
            )
        if hasattr(x, "shape") and np.shape(x) == ():
            return float(x)
        raise TypeError(f"{op}: `{name}` must be a number; got {x!r}")
    return float(x)


def check_softmax_scale(op: str, scale: Any, dim: int) -> float:
    """The ``softmax_scale`` argument as a finite float; ``dim ** -0.5`` when it is None.

    Every op that takes ``softmax_scale`` checks it here: a NaN or infinite scale would turn
    every logit into NaN."""
    if scale is None:
        return float(dim**-0.5)
    value = static_number(op, "softmax_scale", scale)
    if not np.isfinite(value):
        raise ValueError(f"{op}: `softmax_scale` must be a finite number; got {value}")
    return value


@functools.cache
def _dtype_is(dtype: Any, kind: Any) -> bool:
    return bool(jax.numpy.issubdtype(dtype, kind))


def is_floating(x: Any) -> bool:
    """Floating dtype (bfloat16 included); memoised per dtype, as it runs on every call."""
    return _dtype_is(x.dtype, np.floating)


def is_integer(x: Any) -> bool:
    return _dtype_is(x.dtype, np.integer)


def broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
