"""``Executor(...)(op, *arrays, method="shard_map", ...)`` for every op of the registry, on N
host devices, against the same call without ``shard_map``: each op's first conformance
example, its arrays replicated over a mesh of N devices (``in_specs`` ``P()`` for the arrays
passed by position, the rest closed over, ``out_specs`` ``P()``), and where every array is
passed by position with one leading (batch) size that N divides, also split along it
(``P("dp")``: each device runs the op on its rows, tuned for the per-shard shapes). Run by
``test_shard_map_every_op.py`` with the device count set; prints ``ok <op>`` per op and the
ops split by batch."""

from __future__ import annotations

import inspect
import os
import sys
import time
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

import ejkernel
from ejkernel.ops import ConfigCache, ConfigSelectorChain, Executor, OpKernel
from ejkernel.plugins import get_registry
from ejkernel.testing import assert_close
from ejkernel.testing._examples import examples_of


def split_arguments(spec: Any, arguments: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arrays the op takes by position, in order (up to the first it is not given), and
    the rest by name. Positional: the parameters of the public ``ejkernel.<op>`` that are not
    keyword-only, or for an op a plugin adds (no public function), its required arguments."""
    public = getattr(ejkernel, spec.name, None)
    if public is None:
        order = [a.name for a in spec.args if a.required]
    else:
        params = inspect.signature(public).parameters.values()
        order = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    names: list[str] = []
    for name in order:
        if not isinstance(arguments.get(name), jax.Array):
            break
        names.append(name)
    rest = {k: v for k, v in arguments.items() if k not in names}
    return [arguments[name] for name in names], rest


def main(n: int) -> None:
    os.environ["EJKERNEL_AUTOTUNE_POLICY"] = "heuristics"  # whether each op runs, not how fast
    if jax.device_count() != n:
        print(f"expected {n} devices, JAX sees {jax.device_count()}: set XLA_FLAGS first")
        sys.exit(2)
    jax.config.update("jax_disable_most_optimizations", True)
    mesh = jax.make_mesh((n,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    registry = get_registry()
    executor = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    failed, split = [], []
    for op in registry.ops():
        spec = registry.spec(op)
        start = time.perf_counter()
        try:
            arguments = examples_of(spec)[0].build(spec)
            args, kwargs = split_arguments(spec, arguments)
            kernel = type(f"{op}_kernel", (OpKernel,), {"spec": spec})()
            want = executor(kernel, *args, **kwargs)
            got = executor(
                kernel,
                *args,
                method="shard_map",
                mesh=mesh,
                in_specs=tuple(P() for _ in args),
                out_specs=P(),
                **kwargs,
            )
            for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
                assert_close(a, b, rtol=1e-5, atol=1e-5, name=f"{op}: output {i}")
            leading = {a.shape[0] if a.ndim else 0 for a in args}
            if (
                args
                and len(leading) == 1
                and leading.pop() % n == 0
                and not any(isinstance(v, jax.Array) for v in kwargs.values())
            ):
                got = executor(
                    kernel,
                    *args,
                    method="shard_map",
                    mesh=mesh,
                    in_specs=tuple(P("dp") for _ in args),
                    out_specs=P("dp"),
                    **kwargs,
                )
                for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
                    assert_close(a, b, rtol=1e-5, atol=1e-5, name=f"{op} by batch: output {i}")
                split.append(op)
        except Exception as err:
            failed.append(op)
            print(f"FAIL {op}: {type(err).__name__}: {str(err)[:1500]}", flush=True)
            continue
        print(f"ok {op} ({time.perf_counter() - start:.1f}s)", flush=True)
    print(f"split by batch: {' '.join(split)}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
