"""Invocations (one call of an op: abstract args, static kwargs, device) and their cache keys."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import numpy as np

from ejkernel._json import stable_hash
from ejkernel._memo import Memo

__all__ = [
    "Invocation",
    "abstract_value",
    "current_backend",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "fast_signature",
    "device_info",
    "device_kind",
    "sharding_fingerprint",
    "static_value",
]


def current_backend() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the backend of JAX's default device."""
    name = jax.default_backend().lower()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def device_kind() -> str:
    """The default device's kind as the seeds name it: ``"gpu"``, ``"tpu"`` or ``"cpu"``."""
    return current_backend()


@functools.cache
def _device_info(backend: str) -> dict[str, str]:
    dev = jax.devices()[0]
    info = {"backend": backend, "kind": str(getattr(dev, "device_kind", "?"))}
    cc = getattr(dev, "compute_capability", None)
    if cc:
        info["compute_capability"] = str(cc)
    try:
        info["platform_version"] = str(dev.client.platform_version)
    except Exception:  # some clients do not say
        info["platform_version"] = "?"
    return info


def device_info() -> dict[str, str]:
    """Fields of the device fingerprint: backend, device kind, compute capability, versions."""
    return _device_info(current_backend())


def device_fingerprint() -> str:
    """A string naming the default device's kind: ``backend|kind|cc|platform version``."""
    return _fingerprint(current_backend())


@functools.cache
def _fingerprint(backend: str) -> str:
    info = _device_info(backend)
    return "|".join(
        info.get(k, "") for k in ("backend", "kind", "compute_capability", "platform_version")
    )


def sharding_fingerprint(x: Any) -> str | None:
    """Describe an array's sharding (``None`` for single-device or traced arrays)."""
    sharding = getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer) else None
    if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return None
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is not None and mesh is not None:
        axes = ",".join(f"{k}={v}" for k, v in dict(mesh.shape).items())
        return f"{type(sharding).__name__}({spec}; {axes})"
    return f"{type(sharding).__name__}({len(sharding.device_set)} devices)"


def abstract_value(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(tuple(np.shape(x)), jax.numpy.result_type(x))


def static_value(v: Any) -> Any:
    """A JSON-ready, process-stable form of a static argument.

    Floats become their shortest round-trip ``repr`` (``0.125``, not a binary dump; numpy
    floats are converted first); callables become ``module:qualname`` (never an address).
    """
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if isinstance(v, (tuple, list)):
        return [static_value(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): static_value(x) for k, x in v.items()}
    if callable(v):
        return f"{getattr(v, '__module__', '?')}:{getattr(v, '__qualname__', type(v).__name__)}"
    if attrs.has(type(v)):
        return static_value(attrs.asdict(v))
    return repr(v)


def fast_signature(values: Mapping[str, Any] | tuple[Any, ...]) -> tuple[Any, ...]:
    """A cheap in-process hashable summary of arguments (a memo key, never a cache key)."""
    items = values.items() if isinstance(values, Mapping) else enumerate(values)
    out: list[Any] = []
    for k, v in items:
        if v is None or isinstance(v, (bool, int, float, str)):
            out.append((k, type(v), v))
            continue
        shape = getattr(v, "shape", None)
        if shape is not None and hasattr(v, "dtype"):
            shard = None if isinstance(v, jax.core.Tracer) else getattr(v, "sharding", None)
            out.append((k, shape, v.dtype, shard))
        else:
            out.append((k, type(v).__name__, repr(v)))
    return tuple(out)


#: Cache keys by what they hash (the memo policy: :mod:`ejkernel._memo`).
_key_memo: Memo[str] = Memo()


def _array_sig(x: Any) -> dict[str, Any]:
    a = abstract_value(x)
    sig: dict[str, Any] = {"shape": list(a.shape), "dtype": str(a.dtype)}
    shard = sharding_fingerprint(x)
    if shard is not None:
        sig["sharding"] = shard
    return sig


def _is_array(x: Any) -> bool:
    """Arrays, tracers and ``jax.ShapeDtypeStruct`` (``explain``'s stand-ins key as arrays)."""
    return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer, np.generic, jax.ShapeDtypeStruct))


@attrs.frozen(kw_only=True, eq=False)
class Invocation:
    """One call: what the executor, heuristics, ``supports`` and the cache keys see.

    Attributes:
        kernel: the op name, or the :class:`ejkernel.ops.Kernel` being run.
        args: positional arguments as given (arrays may be tracers: read shapes, not values).
        kwargs: keyword arguments; for ops, every argument by name, validated and normalised.
        metadata: free-form details (``grad``: whether the call is being differentiated).
    """

    kernel: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    fast: tuple[Any, ...] | None = attrs.field(default=None, repr=False)

    def fast_signature(self) -> tuple[Any, ...]:
        """:func:`fast_signature` of args and kwargs, computed once per invocation."""
        if self.fast is None:
            object.__setattr__(
                self, "fast", (fast_signature(self.args), fast_signature(self.kwargs))
            )
        return self.fast  # type: ignore[return-value]

    @property
    def arguments(self) -> Mapping[str, Any]:
        """Every argument by name (ops pass all of them as keywords)."""
        return self.kwargs

    @property
    def abstract_args(self) -> tuple[Any, ...]:
        """``jax.ShapeDtypeStruct`` of each positional array (statics unchanged)."""
        return tuple(abstract_value(a) if _is_array(a) else a for a in self.args)

    @property
    def abstract_kwargs(self) -> dict[str, Any]:
        return {k: abstract_value(v) if _is_array(v) else v for k, v in self.kwargs.items()}

    @property
    def device_fingerprint(self) -> str:
        return device_fingerprint()

    @property
    def grad(self) -> bool:
        return bool(self.metadata.get("grad", False))

    def signature(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of arrays, values of statics: JSON-ready and stable."""
        return {
            "args": [_array_sig(a) if _is_array(a) else static_value(a) for a in self.args],
            "kwargs": {
                k: _array_sig(v) if _is_array(v) else static_value(v)
                for k, v in sorted(self.kwargs.items())
            },
        }

    def kernel_name(self) -> str:
        return (
            self.kernel
            if isinstance(self.kernel, str)
            else getattr(self.kernel, "name", type(self.kernel).__name__)
        )

    def key_document(self, *, platform: str, version: str) -> dict[str, Any]:
        """Everything the cache key is made of (stored beside each persistent entry)."""
        return {
            "op": self.kernel_name(),
            "platform": platform,
            "version": version,
            "grad": self.grad,
            "invocation": self.signature(),
            "device": device_info(),
        }

    def cache_key(self, *, platform: str, version: str) -> str:
        """The stable hash of :meth:`key_document` (memoised per process by signature)."""
        memo = (
            self.kernel_name(),
            platform,
            version,
            self.grad,
            device_fingerprint(),
            self.fast_signature(),
        )
        key = _key_memo.get(memo)
        if key is None:
            key = _key_memo.put(
                memo, stable_hash(self.key_document(platform=platform, version=version))
            )
        return key


def default_key_builder_with_sharding(
    kernel: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str:
    """The cache key of ``kernel(*args, **kwargs)``: shapes, dtypes, shardings, statics, device."""
    inv = Invocation(kernel=kernel, args=tuple(args), kwargs=dict(kwargs))
    return inv.cache_key(
        platform=str(getattr(kernel, "platform", "any")),
        version=str(getattr(kernel, "version", "0")),
    )
