"""What the Triton linear-attention tests (gla, recurrent, lightning_attention,
kernel_delta_attention, state_space_v1/v2) share: random queries, keys and values, a
norm-relative error, outputs and gradients
under a fixed cotangent, the comparison of every output leaf and gradient against the
reference or the XLA platform, a run split in two through its carried state, the fused decode,
and the kernels' launches compiled for Hopper."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from ejkernel.testing import assert_close, random_normal


def random_qkv(
    keys: Sequence[jax.Array], b: int, s: int, h: int, dk: int, dv: int, dtype: Any
) -> dict[str, jax.Array]:
    """``query``, ``key`` [B, S, H, K] and ``value`` [B, S, H, V] in ``dtype``, drawn from the
    first three of ``keys``."""
    return {
        "query": random_normal(keys[0], (b, s, h, dk), dtype),
        "key": random_normal(keys[1], (b, s, h, dk), dtype),
        "value": random_normal(keys[2], (b, s, h, dv), dtype),
    }


def rel(a: Any, b: Any) -> float:
    """``|a - b| / |b|`` in float32."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run(fn: Callable[..., Any], arrays: dict[str, jax.Array], **statics: Any) -> tuple[Any, Any]:
    """``fn``'s output and the gradients of every array of ``arrays`` under a fixed
    cotangent (of the output and, with ``return_state``, of the final state); ``fn`` jitted
    with ``statics`` bound (JAX's eager dispatch would take most of an interpreted test's
    time)."""
    bound = jax.jit(functools.partial(fn, **statics))

    def loss(arrays: dict[str, jax.Array]) -> Any:
        out = bound(**arrays)
        o, final = out if statics.get("return_state") else (out, None)
        total = jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.shape[-1]) * 0.7))
        if final is not None:
            total += jnp.sum(final * jnp.sin(jnp.arange(final.shape[-1]) * 0.3))
        return total, out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(arrays)
    return out, grads


def check_against(
    ours: Callable[..., Any],
    reference: Callable[..., Any],
    arrays: dict[str, jax.Array],
    *,
    grads: bool = True,
    tol: float = 1e-4,
    strict: bool | None = None,
    **statics: Any,
) -> None:
    """``ours`` against ``reference``: output, final state and (with ``grads``) every
    gradient, of equal shape and dtype, finite, within ``tol`` by norm, and by
    ``assert_close`` where ``strict`` (by default: where the leaf is float32)."""
    if grads:
        (out, got), (want, exp) = run(ours, arrays, **statics), run(reference, arrays, **statics)
    else:
        ours_, reference_ = (jax.jit(functools.partial(f, **statics)) for f in (ours, reference))
        out, want, got, exp = ours_(**arrays), reference_(**arrays), {}, {}
    outs, wants = jax.tree.leaves(out), jax.tree.leaves(want)
    assert len(outs) == len(wants), (len(outs), len(wants))
    leaves = [*zip(("out", "final"), outs, wants)]
    for name, a, e in leaves + [(f"d{n}", got[n], exp[n]) for n in got]:
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert bool(jnp.isfinite(jnp.asarray(a, jnp.float32)).all()), name
        assert rel(a, e) <= tol, (name, rel(a, e))
        if a.dtype == jnp.float32 if strict is None else strict:
            assert_close(a, e, name=name)


def compare(got: tuple[Any, Any], want: tuple[Any, Any], tol: float) -> None:
    """Two :func:`run` results: every output leaf and every gradient of ``want`` within
    ``tol`` by norm."""
    (out, grads), (ref_out, ref_grads) = got, want
    for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out), strict=True):
        assert rel(a, e) < tol, ("out", rel(a, e))
    for name in ref_grads:
        assert rel(grads[name], ref_grads[name]) < tol, (name, rel(grads[name], ref_grads[name]))


def check_against_xla(
    ours: Callable[..., Any],
    xla: Callable[..., Any],
    arrays: dict[str, jax.Array],
    *,
    tol: float = 2e-2,
    **statics: Any,
) -> None:
    """``ours`` on ``arrays`` against ``xla`` on their float32 copies (at the highest matmul
    precision): output, final state and every gradient finite and within ``tol`` by norm."""
    out, got = jax.jit(lambda a: run(ours, a, **statics))(arrays)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), arrays)
    with jax.default_matmul_precision("highest"):
        want, exp = jax.jit(lambda a: run(xla, a, **statics))(up)
    pairs = [*zip(("out", "final"), jax.tree.leaves(out), jax.tree.leaves(want))]
    for name, a, e in pairs + [(f"d{n}", got[n], exp[n]) for n in got]:
        assert bool(jnp.isfinite(jnp.asarray(a, jnp.float32)).all()), name
        assert rel(a, e) < tol, (name, rel(a, e))


def check_two_halves(
    fn: Callable[..., Any], arrays: dict[str, jax.Array], timed: Sequence[str], **statics: Any
) -> None:
    """``fn`` over the first 13 tokens, then over the rest from the carried state, equals one
    run over all (``timed`` are the arrays with a time axis): output and final state."""
    whole, final = fn(**arrays, **statics, return_state=True)
    first = {n: v[:, :13] if n in timed else v for n, v in arrays.items()}
    second = {n: v[:, 13:] if n in timed else v for n, v in arrays.items()}
    o1, h1 = fn(**first, **statics, return_state=True)
    o2, h2 = fn(**{**second, "initial_state": h1}, **statics, return_state=True)
    assert rel(jnp.concatenate([o1, o2], axis=1), whole) < 1e-5
    assert rel(h2, final) < 1e-5


def check_fused_decode(
    op: Callable[..., Any],
    reference: Callable[..., Any],
    heuristic: Callable[[Any], Any],
    arrays: dict[str, jax.Array],
    **statics: Any,
) -> None:
    """The heuristic picks the fused kernel at ``arrays``; ``op`` on the Triton platform matches
    ``reference`` there, leaf by leaf."""
    assert heuristic(types.SimpleNamespace(kwargs=arrays)).fused
    got = op(**arrays, **statics, platform="triton")
    want = reference(**arrays, **statics)
    for a, e in zip(got, want, strict=True):
        assert rel(a, e) < 1e-5


def assert_launches_fit_hopper(compiled: list[tuple[Any, Any]], count: int) -> None:
    """``count`` launches (of :func:`hopper_launches`), each within the H100's shared memory."""
    assert len(compiled) == count
    for launch, kernel in compiled:
        assert kernel.shared <= 232448, launch.kernel.fn.__name__


def spilled_bytes(cubin: bytes, tmp_path: Path) -> int:
    """The stack and local-memory bytes (register spills) of the kernel in ``cubin``, by ``cuobjdump
    -res-usage`` (Triton's copy); skips the test where that tool is missing."""
    import re
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump in this Triton")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run(
        [str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return sum(int(n) for n in re.findall(r"(?:STACK|LOCAL):(\d+)", usage))


def hopper_launches(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    heuristic: Callable[[Any], Any],
    forward: Callable[..., Any],
    backward: Callable[..., Any],
    arrays: dict[str, jax.Array],
    primal: Callable[..., Any] | None = None,
    **statics: Any,
) -> list[tuple[Any, Any]]:
    """``(launch, compiled)`` for every kernel launch of the op's undifferentiated ``primal``
    (when given; first), jitted ``forward`` and ``backward`` at ``arrays`` under the
    ``heuristic``'s config, compiled for sm_90 on any machine (the interpreter off before the
    heuristic picks, a fresh Triton cache)."""
    from ejkernel_triton import _codegen

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    cfg = heuristic(types.SimpleNamespace(kwargs=arrays))
    jax.clear_caches()  # the forward and backward are jitted: trace them under the recorder
    with _codegen.recorded_launches() as record:
        if primal is not None:
            primal(cfg=cfg, **statics, **arrays)
        out, res = forward(cfg=cfg, **statics, **arrays)
        backward(res, out, cfg=cfg, **statics)
    return [(one, _codegen.compile_launch(one, capability=90)) for one in record]


def check_config_and_gpu_space(
    monkeypatch: pytest.MonkeyPatch,
    config_type: type,
    bad_fields: tuple[str, ...],
    config_space: Callable[[Any], list[Any]],
    heuristic: Callable[[Any], Any],
    *gates: str,
) -> Any:
    """``config_type`` refuses 48 for each of ``bad_fields``; the GPU's space (the interpreter
    off) of B 2, T 8192, H 16, D 128 in bfloat16 (``query``, ``key``, ``value`` and ``gates`` of
    one shape) starts with the heuristic's config, without repeats, more than one; returns the
    call."""
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    for field in bad_fields:
        with pytest.raises(ValueError, match=field):
            config_type(**{field: 48})
    q = jax.ShapeDtypeStruct((2, 8192, 16, 128), jnp.bfloat16)
    inv = types.SimpleNamespace(kwargs=dict.fromkeys(("query", "key", "value", *gates), q))
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space)) > 1
    return inv
