"""The conformance checks: one implementation (op, platform) against the op's reference.

Each check raises ``AssertionError`` when the implementation is wrong and :class:`Declined`
when the case does not apply here (the implementation's ``supports()`` declines it, its
platform is unavailable, it serves another backend). They run without pytest, so a plugin
author can call them from any test runner; :class:`ejkernel.testing.ConformanceSuite` turns
them into tests.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel._invocation import Invocation, current_backend
from ejkernel._registry import Implementation
from ejkernel.specs import OpSpec
from ejkernel.specs._base import jitted_with_statics, static_key
from ejkernel.testing._examples import Example, Invalid
from ejkernel.testing._helpers import TOLERANCES, assert_close

__all__ = [
    "Declined",
    "check_configs",
    "check_forward",
    "check_gradients",
    "check_jit",
    "check_rejects_invalid",
    "check_vmap",
    "tolerance",
]


class Declined(Exception):
    """The case does not apply to this implementation here; ``str()`` says why."""


# -- finding the implementation -------------------------------------------------------------


def _registry() -> Any:
    from ejkernel.plugins import get_registry

    return get_registry()


def _target(op: str, platform: str) -> tuple[OpSpec, list[Implementation]]:
    """The op's spec and the implementations of ``platform`` that can run on this machine."""
    registry = _registry()
    spec = registry.spec(op)
    mine = [i for i in registry.implementations(op) if i.platform == platform]
    if not mine:
        raise LookupError(f"no {platform!r} implementation of {op} is registered")
    backend = current_backend()
    here = [i for i in mine if i.runs_on(backend)]
    if not here:
        served = "/".join(sorted({b for i in mine for b in i.backends}))
        raise Declined(f"{platform} serves {served} for {op}; this device is {backend}")
    available = registry.platform(platform).check(backend)
    if available is not True:
        raise Declined(f"platform {platform!r} is not available: {available}")
    return spec, here


def _supported(
    spec: OpSpec, impls: list[Implementation], args: Mapping[str, Any], grad: bool
) -> None:
    """Raise :class:`Declined` unless ``supports()`` accepts the call (the executor would run
    it); a ``supports()`` that raises is a defect, not a decline."""
    validated = spec.validate(spec.bind((), dict(args)))
    inv = Invocation(kernel=spec.name, kwargs=validated, metadata={"grad": grad})
    reasons = []
    for impl in impls:
        supports = impl.get_supports()
        verdict = True if supports is None else supports(inv)
        if verdict is True:
            return
        reasons.append(str(verdict) if verdict else "declined")
    raise Declined(f"supports() declines: {'; '.join(reasons)}")


def _run(spec: OpSpec, platform: str, args: Mapping[str, Any], cfg: Any = None) -> Any:
    """Call the op through the executor on ``platform``, as ``ejkernel.<op>(...)`` would."""
    from ejkernel._executor import default_executor

    return default_executor().run_op(spec, spec.bind((), dict(args)), platform=platform, cfg=cfg)


def _reference(spec: OpSpec, args: Mapping[str, Any]) -> Any:
    """The spec's reference on validated arguments, jitted (eager, its many small ops would
    each compile), with the statics closed over."""
    arrays, statics = _split(spec.validate(spec.bind((), dict(args))))
    return _jitted_reference(spec, statics)(arrays)


def _jitted_reference(spec: OpSpec, statics: Mapping[str, Any]) -> Callable[..., Any]:
    """``arrays -> spec.reference(**statics, **arrays)``, jitted: one function (and so one
    compile a set of shapes) for every check of the op with these statics."""
    try:
        return jitted_with_statics(spec.reference, static_key(statics, statics))
    except TypeError:  # an unhashable static: a function of its own
        return jax.jit(lambda arrs: spec.reference(**statics, **arrs))


def _reference_vjp(spec: OpSpec, statics: Mapping[str, Any]) -> Callable[..., Any]:
    """``(primals, arrays, cotangent) -> the VJP of the reference``, jitted, over validated
    arguments: one function for every gradient check of the op with these statics."""
    try:
        return _reference_vjp_of(spec, static_key(statics, statics))
    except TypeError:
        return _vjp_of_reference(spec, dict(statics))


@functools.lru_cache(maxsize=512)
def _reference_vjp_of(spec: OpSpec, key: tuple[Any, ...]) -> Any:
    return _vjp_of_reference(spec, {k: v for k, _, v in key})


def _vjp_of_reference(spec: OpSpec, statics: dict[str, Any]) -> Any:
    def run(p: dict[str, Any], arrs: dict[str, Any], ct: Any) -> Any:
        validated = lambda q: spec.validate(spec.bind((), {**statics, **arrs, **q}))
        _, pullback = jax.vjp(lambda q: spec.reference(**validated(q)), p)
        return pullback(ct)[0]

    return jax.jit(run)


def _split(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, everything else): arrays may be traced; the rest is closed over."""
    arrays = {k: v for k, v in args.items() if isinstance(v, jax.Array | np.ndarray)}
    return arrays, {k: v for k, v in args.items() if k not in arrays}


# -- comparing ------------------------------------------------------------------------------


def tolerance(spec: OpSpec, dtype: Any, scale: float = 1.0) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype``: the op's own entry (``OpSpec.tolerances``) or the table
    :data:`ejkernel.testing.TOLERANCES`, times ``scale``."""
    name = str(jnp.dtype(dtype))
    table = {**TOLERANCES, **(spec.tolerances or {})}
    rtol, atol = table.get(name, table["float32"])
    return rtol * scale, atol * scale


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.floating))


def _compare(spec: OpSpec, actual: Any, expected: Any, *, scale: float, what: str) -> None:
    """Same tree, shapes and dtypes as the reference, values within the dtype's tolerance."""
    got: Any = jax.tree_util.tree_structure(actual)
    want: Any = jax.tree_util.tree_structure(expected)
    assert got == want, f"{what}: output structure {got} differs from the reference's {want}"
    leaves = zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected))
    for i, (a, e) in enumerate(leaves):
        name = f"{what} (output leaf {i})"
        assert tuple(a.shape) == tuple(e.shape), f"{name}: shape {a.shape} != reference {e.shape}"
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != reference {e.dtype}"
        if not _is_float(e):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
            continue
        rtol, atol = tolerance(spec, e.dtype, scale)
        assert_close(a, e, name=name, rtol=rtol, atol=atol)


# -- the checks -----------------------------------------------------------------------------


def check_forward(
    op: str, platform: str, example: Example, dtype: str = "float32", *, seed: int = 0
) -> None:
    """The platform's output equals the reference's for ``example`` in ``dtype``.

    Raises:
        Declined: the implementation declines the call or cannot run here.
        AssertionError: a wrong structure, shape, dtype or value.
    """
    spec, impls = _target(op, platform)
    args = example.build(spec, dtype, seed)
    _supported(spec, impls, args, grad=False)
    expected = _reference(spec, args)  # first: an implementation may donate its inputs
    actual = _run(spec, platform, args)
    _compare(spec, actual, expected, scale=example.tolerance, what=f"{op}[{platform}] {example}")


def _differentiable(spec: OpSpec, args: Mapping[str, Any]) -> list[str]:
    return [a.name for a in spec.args if a.differentiable and _is_float(args.get(a.name))]


def _cotangent(out: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed + 104729)

    def one(x: Any) -> Any:
        if _is_float(x):
            return jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        return np.zeros(x.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(one, out)


def check_gradients(
    op: str, platform: str, example: Example, dtype: str = "float32", *, seed: int = 0
) -> None:
    """Under ``jit``, the vector-Jacobian product of the platform equals autodiff of the
    reference, for every differentiable argument of ``example``, with a random cotangent.

    Raises:
        Declined: a forward-only op, an example without gradients, or an implementation that
            declines the differentiated call.
        AssertionError: a wrong gradient.
    """
    spec, impls = _target(op, platform)
    if not spec.differentiable:
        raise Declined(f"{op} is forward only")
    if example.grad is False:
        raise Declined(f"example {example} checks no gradients")
    args = example.build(spec, dtype, seed)
    names = _differentiable(spec, args)
    if not names:
        raise Declined(f"example {example} has no differentiable array")
    _supported(spec, impls, args, grad=True)
    primals = {k: args[k] for k in names}
    arrays, statics = _split({k: v for k, v in args.items() if k not in primals})
    validated = lambda full: spec.validate(spec.bind((), full))

    def impl_fn(p: dict[str, Any], arrs: dict[str, Any]) -> Any:
        return _run(spec, platform, {**statics, **arrs, **p})

    def ref_fn(p: dict[str, Any], arrs: dict[str, Any]) -> Any:
        return spec.reference(**validated({**statics, **arrs, **p}))

    def vjp_of(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(p: dict[str, Any], arrs: dict[str, Any], ct: Any) -> Any:
            _, pullback = jax.vjp(lambda q: fn(q, arrs), p)
            return pullback(ct)[0]

        return jax.jit(run)

    out_shape = jax.eval_shape(lambda p: ref_fn(p, arrays), primals)
    ct = _cotangent(out_shape, seed)
    expected = _reference_vjp(spec, statics)(primals, arrays, ct)
    actual = vjp_of(impl_fn)(primals, arrays, ct)
    for name in names:
        _compare(
            spec,
            actual[name],
            expected[name],
            scale=example.tolerance,
            what=f"{op}[{platform}] {example}: gradient of `{name}`",
        )


def check_jit(op: str, platform: str, example: Example, *, seed: int = 0) -> None:
    """Under ``jax.jit``, with every array argument traced (lengths and offsets included),
    the platform's output equals the reference's."""
    spec, impls = _target(op, platform)
    args = example.build(spec, "float32", seed)
    _supported(spec, impls, args, grad=False)
    expected = _reference(spec, args)
    arrays, statics = _split(args)
    actual = jax.jit(lambda arrs: _run(spec, platform, {**statics, **arrs}))(arrays)
    _compare(
        spec, actual, expected, scale=example.tolerance, what=f"{op}[{platform}] jit {example}"
    )


def check_vmap(op: str, platform: str, example: Example, *, seed: int = 0) -> None:
    """Under ``jax.vmap`` over a new leading axis of every floating array (two different
    draws), the platform's output equals the reference's on each draw."""
    spec, impls = _target(op, platform)
    draws = [example.build(spec, "float32", seed + i) for i in range(2)]
    first = draws[0]
    _supported(spec, impls, first, grad=False)
    batched = {k: v for k, v in first.items() if _is_float(v)}
    if not batched:
        raise Declined(f"example {example} has no floating array to map over")
    # Integer inputs (lengths, tables) are the first draw's in both, so both draws are valid.
    draws[1] = {**first, **{k: draws[1][k] for k in batched}}
    expected = [_reference(spec, d) for d in draws]
    stacked = {k: jnp.stack([d[k] for d in draws]) for k in batched}
    arrays, statics = _split({k: v for k, v in first.items() if k not in batched})
    actual = jax.vmap(
        lambda b, arrs: _run(spec, platform, {**statics, **arrs, **b}), in_axes=(0, None)
    )(stacked, arrays)
    for i, want in enumerate(expected):
        got = jax.tree_util.tree_map(lambda x, i=i: x[i], actual)
        _compare(
            spec, got, want, scale=example.tolerance, what=f"{op}[{platform}] vmap {example} #{i}"
        )


@contextlib.contextmanager
def _spied(impls: list[Implementation], calls: list[str]) -> Iterator[None]:
    """Replace the implementations by spies that record a call and fail."""
    saved = []
    for impl in impls:
        had = "target" in impl._loaded
        saved.append((impl, had, impl._loaded.get("target")))

        def spy(*args: Any, _name: str = impl.name, **kwargs: Any) -> Any:
            calls.append(_name)
            raise AssertionError(f"{_name} ran on invalid input")

        impl._loaded["target"] = spy
    try:
        yield
    finally:
        for impl, had, fn in saved:
            if had:
                impl._loaded["target"] = fn
            else:
                impl._loaded.pop("target", None)


def check_rejects_invalid(
    op: str, platform: str, example: Example, invalid: Invalid, *, seed: int = 0
) -> None:
    """``invalid`` applied to ``example`` raises ValueError or TypeError naming the op, and no
    implementation of ``platform`` is called."""
    spec, impls = _target(op, platform)
    args = invalid.change(example.build(spec, "float32", seed))
    calls: list[str] = []
    with _spied(impls, calls):
        try:
            _run(spec, platform, args)
        except (ValueError, TypeError) as err:
            assert op in str(err), f"{op}: the error for {invalid} does not name the op: {err}"
        else:
            raise AssertionError(f"{op}[{platform}]: invalid input ({invalid}) was accepted")
    assert not calls, f"{op}[{platform}]: {calls} ran on invalid input ({invalid})"


def check_configs(op: str, platform: str, example: Example, *, seed: int = 0) -> None:
    """Every config of the implementation's ``config_space`` gives the reference's output."""
    spec, impls = _target(op, platform)
    args = example.build(spec, "float32", seed)
    _supported(spec, impls, args, grad=False)
    validated = spec.validate(spec.bind((), dict(args)))
    inv = Invocation(kernel=spec.name, kwargs=validated, metadata={"grad": False})
    space = impls[0].get_config_space()
    if space is None:
        raise Declined(f"{op}[{platform}] has no config space")
    expected = _reference(spec, args)
    for cfg in space(inv):
        actual = _run(spec, platform, args, cfg=cfg)
        _compare(spec, actual, expected, scale=example.tolerance, what=f"{op}[{platform}] {cfg!r}")
