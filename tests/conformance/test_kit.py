"""The conformance kit itself: it passes a correct implementation, fails wrong ones (values,
dtypes, gradients, jit, invalid input reaching a kernel), skips what ``supports()`` declines,
and runs as documented (``pytest --pyargs ejkernel.testing.conformance``)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import plugins
from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import defvjp, hookimpl
from ejkernel.specs import Arg, OpSpec, builtin_spec
from ejkernel.specs.mean_pooling import mean_pooling_reference
from ejkernel.testing import (
    Declined,
    Example,
    Invalid,
    check_forward,
    check_gradients,
    check_jit,
    check_rejects_invalid,
    check_vmap,
    conformance_cases,
    examples_of,
)

DENSE, PACKED = examples_of(builtin_spec("mean_pooling"))[:2]


def _install(name: str, register: Callable[[Any], None]) -> None:
    """Register a plugin named ``name`` whose ``ejkernel_register`` is ``register``."""
    plugin = types.SimpleNamespace(
        ejkernel_api_version=hookimpl(lambda: API_VERSION),
        ejkernel_register=hookimpl(lambda registry: register(registry)),
    )
    plugins.register_plugin(plugin, name=name)


def _mean_pooling(platform: str, fn: Callable[..., Any], supports: Any = None) -> None:
    _install(
        platform,
        lambda r: r.register("mean_pooling", platform=platform, backend="any", supports=supports)(
            fn
        ),
    )


def reference_pooling(*, x: jax.Array, cu_seqlens: jax.Array | None = None, cfg: Any = None) -> Any:
    return mean_pooling_reference(x, cu_seqlens=cu_seqlens)


def test_a_correct_implementation_passes_every_check() -> None:
    _mean_pooling("good", reference_pooling)
    for example in (DENSE, PACKED):
        for dtype in ("float32", "bfloat16"):
            check_forward("mean_pooling", "good", example, dtype)
        check_gradients("mean_pooling", "good", example)
    check_jit("mean_pooling", "good", PACKED)
    check_vmap("mean_pooling", "good", PACKED)
    for case in conformance_cases("invalid", platforms=("good",), ops=("mean_pooling",)):
        assert case.invalid is not None
        check_rejects_invalid("mean_pooling", "good", DENSE, case.invalid)


def test_a_wrong_value_fails_the_forward_check() -> None:
    def summed(*, x: jax.Array, cu_seqlens: Any = None, cfg: Any = None) -> Any:
        return reference_pooling(x=x, cu_seqlens=cu_seqlens) * 1.001

    _mean_pooling("sum", summed)
    with pytest.raises(AssertionError, match="mean_pooling\\[sum\\]"):
        check_forward("mean_pooling", "sum", DENSE)


def test_an_output_in_another_dtype_fails_the_forward_check() -> None:
    def upcast(*, x: jax.Array, cu_seqlens: Any = None, cfg: Any = None) -> Any:
        return reference_pooling(x=x.astype(jnp.float32), cu_seqlens=cu_seqlens)

    _mean_pooling("upcast", upcast)
    check_forward("mean_pooling", "upcast", DENSE, "float32")
    with pytest.raises(AssertionError, match="dtype float32 != reference bfloat16"):
        check_forward("mean_pooling", "upcast", DENSE, "bfloat16")


def test_a_wrong_backward_fails_the_gradient_check() -> None:
    def fn(*, x: jax.Array, cu_seqlens: Any = None, cfg: Any = None) -> Any:
        return reference_pooling(x=x, cu_seqlens=cu_seqlens)

    def fwd(*, x: jax.Array, cu_seqlens: Any = None, cfg: Any = None) -> Any:
        return fn(x=x, cu_seqlens=cu_seqlens), (x, cu_seqlens)

    def bwd(res: Any, d_out: jax.Array, *, cfg: Any = None) -> dict[str, Any]:
        x, cu = res
        _, pullback = jax.vjp(lambda y: mean_pooling_reference(y, cu_seqlens=cu), x)
        return {"x": 1.01 * pullback(d_out)[0]}

    _mean_pooling("badgrad", defvjp(fn, fwd, bwd))
    check_forward("mean_pooling", "badgrad", PACKED)
    with pytest.raises(AssertionError, match="gradient of `x`"):
        check_gradients("mean_pooling", "badgrad", PACKED)


def test_what_supports_declines_is_skipped_and_what_it_accepts_is_checked() -> None:
    def dense_only(inv: Any) -> bool | str:
        return True if inv.kwargs["cu_seqlens"] is None else "no packed sequences"

    def wrong_when_packed(*, x: jax.Array, cu_seqlens: Any = None, cfg: Any = None) -> Any:
        return reference_pooling(x=x, cu_seqlens=cu_seqlens) + (cu_seqlens is not None)

    _mean_pooling("dense", wrong_when_packed, supports=dense_only)
    check_forward("mean_pooling", "dense", DENSE)
    with pytest.raises(Declined, match="no packed sequences"):
        check_forward("mean_pooling", "dense", PACKED)


def test_an_implementation_that_needs_concrete_lengths_fails_under_jit() -> None:
    def concrete(*, x: jax.Array, cu_seqlens: Any = None, cfg: Any = None) -> Any:
        if cu_seqlens is not None:
            int(cu_seqlens[0])  # fine eagerly; a traced length cannot be read
        return reference_pooling(x=x, cu_seqlens=cu_seqlens)

    _mean_pooling("concrete", concrete)
    check_forward("mean_pooling", "concrete", PACKED)
    with pytest.raises(jax.errors.ConcretizationTypeError):
        check_jit("mean_pooling", "concrete", PACKED)


def _probe_spec(validate: Callable[[dict[str, Any]], dict[str, Any]], examples: Any) -> OpSpec:
    return OpSpec(
        name="kit_probe",
        args=(Arg(name="x", array=True, required=True, differentiable=True),),
        validate=validate,
        reference=lambda x: 2.0 * x,
        examples=examples,
    )


def _doubler(*, x: jax.Array, cfg: Any = None) -> jax.Array:
    return 2.0 * x


def test_invalid_input_that_reaches_the_implementation_fails_the_kit() -> None:
    lenient = _probe_spec(
        lambda a: a,
        lambda: [
            Example(name="x5", arrays={"x": ((5,), "float")}),
            Invalid.replace("x-integer", x=lambda a: a["x"].astype(jnp.int32)),
        ],
    )

    def register(r: Any) -> None:
        r.add_op(lenient)
        r.register("kit_probe", platform="probe", backend="any")(_doubler)

    _install("probe", register)
    example = examples_of(lenient)[0]
    check_forward("kit_probe", "probe", example)
    with pytest.raises(AssertionError, match="ran on invalid input"):
        check_rejects_invalid("kit_probe", "probe", example, Invalid.extra_axis("x"))


def test_an_op_without_examples_gets_one_case_that_says_so() -> None:
    def register(r: Any) -> None:
        r.add_op(_probe_spec(lambda a: a, None))
        r.register("kit_probe", platform="probe", backend="any")(_doubler)

    _install("probe", register)
    cases = conformance_cases("forward", platforms=("probe",))
    assert [(c.op, c.example) for c in cases] == [("kit_probe", None)]
    assert str(cases[0]) == "kit_probe-probe-no-examples"
    with pytest.raises(pytest.skip.Exception, match="declares no conformance examples"):
        cases[0].need_example()


def test_a_platform_nobody_registered_is_an_error_not_an_empty_run() -> None:
    with pytest.raises(ValueError, match=r"registered platforms: .*xla"):
        conformance_cases("forward", platforms=("nope",))


def test_examples_are_drawn_from_the_seed_and_never_zero() -> None:
    spec = builtin_spec("mean_pooling")
    a, b = PACKED.build(spec, "bfloat16", seed=3), PACKED.build(spec, "bfloat16", seed=3)
    assert a["x"].dtype == jnp.bfloat16 and np.array_equal(np.asarray(a["x"]), np.asarray(b["x"]))
    assert np.all(np.asarray(a["x"], np.float32) != 0.0)
    assert a["cu_seqlens"].tolist() == [3, 13, 13, 40, 41, 66]


def test_every_built_in_op_declares_examples_and_invalid_changes() -> None:
    from ejkernel.specs import builtin_ops
    from ejkernel.testing import invalid_cases_of

    for op in builtin_ops():
        spec = builtin_spec(op)
        assert len(examples_of(spec)) >= 2, op
        own = [i for i in invalid_cases_of(spec) if i.name.split("-")[0] != "unexpected"]
        assert len(own) >= 3, op


def test_the_pytest_plugin_is_registered_and_the_old_helper_names_still_import() -> None:
    eps = importlib.metadata.entry_points(group="pytest11")
    assert any(ep.value == "ejkernel.testing.pytest_plugin" for ep in eps)
    import ejkernel.testing as kit

    old = ("TOLERANCES", "assert_close", "attention_inputs", "random_normal")  # since the start
    assert all(hasattr(kit, name) for name in old)
    assert attrs.has(kit.AttentionShape) and len(kit.ATTENTION_SHAPES) >= 3


def _pytest(tmp_path: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EJKERNEL_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:benchmark",
            "-q",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_documented_command_runs_the_kit_for_one_platform(tmp_path: Any) -> None:
    done = _pytest(
        tmp_path,
        "--pyargs",
        "ejkernel.testing.conformance",
        "--ejkernel-platform",
        "xla",
        "--ejkernel-op",
        "mean_pooling",
        "-k",
        "forward or invalid",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert list(tmp_path.iterdir()) == []  # the kit kept its caches in pytest's temp folders

    bad = _pytest(
        tmp_path, "--pyargs", "ejkernel.testing.conformance", "--ejkernel-platform", "nope"
    )
    assert bad.returncode == 4, bad.stdout + bad.stderr
    assert "no implementation of any op is registered for platform 'nope'" in bad.stderr


def test_the_reference_is_one_jitted_function_for_each_set_of_statics() -> None:
    from ejkernel.testing import _checks

    spec = builtin_spec("flash_attention")
    same = _checks._jitted_reference(spec, {"causal": True, "softmax_scale": 0.5})
    again = _checks._jitted_reference(spec, {"softmax_scale": 0.5, "causal": True})
    other = _checks._jitted_reference(spec, {"causal": 1, "softmax_scale": 0.5})
    unhashable = {"causal": True, "softmax_scale": [0.5]}

    assert same is again
    assert other is not same  # 1 and True are different statics
    # an unhashable static: a function of its own each time, never a cache error
    assert _checks._jitted_reference(spec, unhashable) is not _checks._jitted_reference(
        spec, unhashable
    )
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, 2, 8))
    want = spec.reference(query=x, key=x, value=x, causal=True, softmax_scale=0.5)
    got = same({"query": x, "key": x, "value": x})
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert _checks._reference_vjp(spec, {"causal": True}) is _checks._reference_vjp(
        spec, {"causal": True}
    )
