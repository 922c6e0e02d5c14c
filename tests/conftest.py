"""Every test runs with its own cache folder, the heuristics policy and a fresh registry."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

#: The compilation cache the run's processes share (pytest-xdist workers and the children
#: some tests start inherit it): a temporary folder the first process makes and removes.
_JAX_CACHE = "EJKERNEL_TESTS_JAX_CACHE"

#: XLA's CPU fusions by its older emitters: about half the compile time of these tests' small
#: programs. And no concurrency-optimized scheduling: with it, Mosaic GPU's interpreter (each
#: warpgroup a computation on its own thread, synchronised by host callbacks) hung at random in
#: the grouped-matmul tests on a 2-core machine, threads waiting on barriers and in
#: ``execute_sharded``; without it those tests pass every time. Set where the default backend
#: is the CPU and this jaxlib knows the flags (XLA stops a process at an unknown flag), found
#: out once, by the first process of the run.
_CPU_FLAG = (
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_enable_concurrency_optimized_scheduler=false"
)
_CPU_FLAG_CHECKED = "EJKERNEL_TESTS_XLA_FLAG_CHECKED"


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
    _reset_mosaic_gpu_interpreter()
    yield
    plugins.reset()
    _executor._default = None
    errors._reset_warnings_for_tests()
    _recording.clear_invocations()
    _labels.forget_stamps()


#: JAX's Mosaic GPU interpreter keeps the simulated GPU's memory and barriers in module globals.
#: Some interpretations leave them behind (the Pallas grouped matmul's forward and backward in
#: one test), and the next interpreted kernel then waits on a stale barrier for ever: each test
#: starts from a fresh simulated GPU.
_MOSAIC_GPU_INTERPRETER = "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks"


def _reset_mosaic_gpu_interpreter() -> None:
    module = sys.modules.get(_MOSAIC_GPU_INTERPRETER)  # only where a test has loaded it
    reset = getattr(module, "reset_gpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def pytest_configure(config):
    """CPU dispatch is synchronous (``jax_cpu_enable_async_dispatch`` off): the interpreted
    kernels run through host callbacks, and XLA's asynchronous CPU dispatch can wedge with
    callbacks in flight (jax-ml/jax#25861: every thread idle, the main one waiting for an
    execution slot). The flag is read when JAX creates its CPU client, so it is set before
    anything starts a backend.

    On a CPU, compile without XLA's and LLVM's expensive optimisations
    (``jax_disable_most_optimizations``) and with XLA's older fusion emitters and no
    concurrency-optimized scheduling (:data:`_CPU_FLAG`): these tests spend most of their time
    compiling small programs, which then run on inputs of a few kilobytes, and the scheduler
    hangs Mosaic GPU's interpreter; and share one persistent
    compilation cache among the run's processes, so a program another test (or the other
    worker) compiled is read back. GPU runs keep the usual compiler and no cache.

    With ``EJKERNEL_TEST_GPUS=n`` (``benchmarks/gpu_tests.sh``), pytest-xdist worker ``i``
    sees GPU ``i mod n`` only, so the workers spread their memory over the host's GPUs."""
    gpus = int(os.environ.get("EJKERNEL_TEST_GPUS") or 0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if gpus > 1 and worker.startswith("gw"):
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker[2:]) % gpus)
    if not gpus and not os.environ.get(_CPU_FLAG_CHECKED):
        os.environ[_CPU_FLAG_CHECKED] = "1"
        flags = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_FLAG}".strip()
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.default_backend())"],
            env={**os.environ, "XLA_FLAGS": flags},
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "cpu":
            os.environ["XLA_FLAGS"] = flags
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    if jax.default_backend() != "cpu":
        return
    jax.config.update("jax_disable_most_optimizations", True)
    cache = os.environ.get(_JAX_CACHE)
    if cache is None:
        cache = tempfile.mkdtemp(prefix="ejkernel-jax-cache-")
        os.environ[_JAX_CACHE] = cache
        config.stash[_OWN_CACHE] = cache
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_OWN_CACHE = pytest.StashKey[str]()


def pytest_unconfigure(config):
    """The process that made the shared compilation cache removes it."""
    cache = config.stash.get(_OWN_CACHE, None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop(_JAX_CACHE, None)


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


#: A file each test's outcome is appended to as it ends (``outcome nodeid seconds [why]``), by
#: the controlling process (pytest-xdist's workers report to it): what a run cut short by a
#: time limit still tells (``benchmarks/gpu_tests.sh``). A failure's whole report goes to the
#: same path with ``.failures`` appended.
_OUTCOME_LOG = "EJKERNEL_TEST_LOG"


def pytest_runtest_logreport(report):
    path = os.environ.get(_OUTCOME_LOG)
    if (
        not path
        or "PYTEST_XDIST_WORKER" in os.environ
        or not (report.when == "call" or report.outcome != "passed")
    ):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    why = ""
    if crash and report.failed:
        why = " " + " | ".join(line.strip() for line in crash.message.splitlines() if line.strip())
        with open(f"{path}.failures", "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    with open(path, "a") as f:
        f.write(f"{report.outcome} {report.nodeid} {report.duration:.1f}s{why[:400]}\n")
