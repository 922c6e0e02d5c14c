"""The plugin as a user meets it: discovered through its entry point, selected only when
asked, its new op callable, its supports() reason shown, nothing heavy imported."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ejkernel_plugin_example import example_rms_norm
from ejkernel_plugin_example.ops import mean_pooling as example_mean_pooling
from ejkernel_plugin_example.specs.example_rms_norm import example_rms_norm_reference

import ejkernel
from ejkernel.errors import NoImplementationError
from ejkernel.plugins import plugin_infos


def _x(*shape: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)


def test_the_plugin_is_discovered_through_its_entry_point() -> None:
    info = {p.name: p for p in plugin_infos()}["example"]
    assert info.status == "loaded" and info.module == "ejkernel_plugin_example.plugin"
    assert info.distribution is not None and info.distribution.startswith("ejkernel-plugin-example")


def test_installing_it_changes_nothing_until_asked_for() -> None:
    x = _x(2, 37, 80)
    assert ejkernel.explain("mean_pooling", x).platform != "example"
    chosen = ejkernel.explain("mean_pooling", x, platform="example")
    assert chosen.platform == "example"
    np.testing.assert_allclose(
        ejkernel.mean_pooling(x, platform="example"), ejkernel.mean_pooling(x), rtol=1e-5, atol=1e-6
    )


def test_the_new_op_runs_and_is_explained() -> None:
    x, weight = _x(3, 37, 48), _x(48) + 1.0
    out = example_rms_norm(x, weight, eps=1e-5)
    np.testing.assert_allclose(
        out, example_rms_norm_reference(x, weight, eps=1e-5), rtol=1e-5, atol=1e-6
    )
    assert ejkernel.explain("example_rms_norm", x, weight).platform == "example"


def test_bad_input_to_the_new_op_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"example_rms_norm: `weight` must be \[D\]"):
        example_rms_norm(_x(2, 48), _x(47))


def test_a_declined_call_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(example_mean_pooling, "MAX_TOKENS", 64)
    with pytest.raises(NoImplementationError, match="lose float32 precision"):
        ejkernel.mean_pooling(_x(1, 129, 8), platform="example")
    assert ejkernel.explain("mean_pooling", _x(1, 129, 8)).platform != "example"


def test_disabling_the_plugin_removes_the_new_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_DISABLE_PLUGINS", "example")
    ejkernel.plugins.reset()
    with pytest.raises(KeyError, match="unknown op 'example_rms_norm'"):
        ejkernel.explain("example_rms_norm", _x(2, 8), _x(8))


def test_discovery_imports_no_implementation_module() -> None:
    code = (
        "import sys, ejkernel.plugins as p; p.get_registry(); "
        "print(sorted(m for m in sys.modules if m.startswith('ejkernel_plugin_example.ops.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
