"""Every test runs with its own cache folder, the heuristics policy and a fresh registry."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_ejkernel(tmp_path, monkeypatch):
    from ejkernel import _executor, _labels, _recording, errors, plugins

    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "ejkernel-cache"))
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    for name in (
        "EJKERNEL_PLATFORM",
        "EJKERNEL_DISABLE_PLUGINS",
        "EJKERNEL_PLUGINS_AUTOLOAD",
        "EJKERNEL_LOG_AUTOTUNE",
        "EJKERNEL_OPS_RECORD",
        "EJKERNEL_OPS_STAMP",
        "EJKERNEL_SHIPPED",
        "EJKERNEL_SHARED_MEMORY_LIMIT",
    ):
        monkeypatch.delenv(name, raising=False)
    plugins.reset()
    _executor._default = None
    errors._reset_warnings_for_tests()
    _recording.clear_invocations()
    yield
    plugins.reset()
    _executor._default = None
    errors._reset_warnings_for_tests()
    _recording.clear_invocations()
    _labels.forget_stamps()


def pytest_configure(config):
    """CPU dispatch is synchronous (``jax_cpu_enable_async_dispatch`` off): the interpreted
    kernels run through host callbacks, and XLA's asynchronous CPU dispatch can wedge with
    callbacks in flight (jax-ml/jax#25861: every thread idle, the main one waiting for an
    execution slot). The flag is read when JAX creates its CPU client, so it is set before
    anything starts a backend.

    On a CPU, compile without XLA's and LLVM's expensive optimisations
    (``jax_disable_most_optimizations``): these tests spend most of their time compiling small
    programs, which then run on inputs of a few kilobytes. GPU runs keep the usual compiler."""
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    if jax.default_backend() == "cpu":
        jax.config.update("jax_disable_most_optimizations", True)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where JAX's default backend is a GPU; the tests listed in
    ``tests/slow.txt`` are marked `slow` (the CI run deselects them)."""
    import pathlib

    import jax

    listed = pathlib.Path(__file__).with_name("slow.txt").read_text().splitlines()
    slow = {line.strip() for line in listed if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the lent H100)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
