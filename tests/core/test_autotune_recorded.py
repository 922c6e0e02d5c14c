"""Batch tuning (``autotune_recorded``): records tuned in one process, shipped to another;
the result as an overlay, in memory, on disk and in a file; failures skipped; parallel
compiles and serial timings."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import time
import types
from typing import Any, ClassVar

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel import _batch_tune
from ejkernel._records import dumps
from ejkernel.errors import AutotuneWarning
from ejkernel.ops import (
    AutotuneResult,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    PersistentCache,
    RecordedInvocation,
    autotune_recorded,
    overlay_cache,
)
from ejkernel.plugins import hookimpl, register_plugin
from ejkernel.specs.flash_attention import flash_attention_reference

SHAPE = (1, 8, 2, 8)


def qkv(shape: tuple[int, ...] = SHAPE) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(k, shape) for k in keys)


def record(shape: tuple[int, ...] = SHAPE, *, grad: bool = False, **static: Any):
    """The record of ``flash_attention(q, k, v, **static)``, as recording makes it."""
    spec = ejkernel.plugins.get_registry().spec("flash_attention")
    q, k, v = qkv(shape)
    arguments = spec.validate(spec.bind((q, k, v), static))
    return RecordedInvocation.from_arguments(
        "flash_attention", arguments, [a.name for a in spec.args if a.array], grad=grad
    )


# -- shipped to another process -----------------------------------------------------------

CHILD_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def run_python(args: list[str], cache: str) -> str:
    env = dict(os.environ, EJKERNEL_CACHE_DIR=cache, **CHILD_ENV)
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_record_tune_in_a_child_import_in_a_third_process_explain_says_persistent(tmp_path):
    shape = (1, 256, 2, 16)  # the XLA platform has several candidates from 256 tokens
    shapes = tmp_path / "records.json"
    shapes.write_text(dumps([record(shape), record(shape, grad=True, causal=True)]))
    out = tmp_path / "tuned.json"
    tuner = run_python(
        ["-m", "ejkernel", "tune", "--shapes", str(shapes), "--out", str(out)],
        str(tmp_path / "tuner-cache"),
    )
    assert "tuned 2 configs" in tuner
    exported = json.loads(out.read_text())
    assert exported["schema"] == 1 and len(exported["entries"]) == 2
    for entry in exported["entries"].values():
        assert entry["source"] == "autotune" and entry["timings_ms"] and entry["key"]["op"]
    probe = (
        "import jax, ejkernel, sys\n"
        "from ejkernel.ops import PersistentCache\n"
        "print(PersistentCache().import_(sys.argv[1]))\n"
        f"q = jax.ShapeDtypeStruct({shape}, 'float32')\n"
        "for grad, causal in ((False, False), (True, True), (False, True)):\n"
        "    s = ejkernel.explain('flash_attention', q, q, q, causal=causal, grad=grad)\n"
        "    print(s.source, s.origin, s.key)\n"
    )
    lines = run_python(["-c", probe, str(out)], str(tmp_path / "user-cache")).split("\n")
    assert lines[0] == "2"
    (fwd, fwd_origin, fwd_key), (bwd, bwd_origin, bwd_key), (untuned, _, _) = (
        line.split() for line in lines[1:4]
    )
    assert (fwd, fwd_origin, bwd, bwd_origin) == ("persistent", "autotune") * 2
    assert {fwd_key, bwd_key} == set(exported["entries"])
    assert untuned == "heuristic"  # the forward of the causal call was not recorded


def test_cli_tune_rejects_an_unknown_platform_and_a_bad_file(tmp_path, capsys):
    from ejkernel.cli import main

    shapes = tmp_path / "records.json"
    shapes.write_text(dumps([record()]))
    out = str(tmp_path / "o.json")
    assert main(["tune", "--shapes", str(shapes), "--out", out, "--platforms", "nope"]) == 1
    assert "platforms" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["tune", "--shapes", str(tmp_path / "bad.json"), "--out", out]) == 1
    assert "cannot read records" in capsys.readouterr().err


# -- the result: overlay, memory, persistent, file -------------------------------------------


def test_with_result_is_an_overlay_apply_puts_it_in_memory(toy):
    q, k, v = qkv()
    result = autotune_recorded([record()], apply=False, max_workers=2)
    assert len(result) == 1 and not result.failures
    (tuned,) = result
    assert tuned.op == "flash_attention" and tuned.platform == "toy" and not tuned.grad
    assert result[tuned.key] is tuned and tuned.key in result
    assert len(tuned.timings_ms) == 3 and tuned.best_ms == min(tuned.timings_ms.values())
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"
    with result:
        s = ejkernel.explain("flash_attention", q, k, v)
        assert (s.source, s.config, s.key) == ("overlay", tuned.config, tuned.key)
        with result:  # re-entrant
            assert ejkernel.explain("flash_attention", q, k, v).source == "overlay"
    with overlay_cache(result):
        assert ejkernel.explain("flash_attention", q, k, v).source == "overlay"
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"
    result.apply()
    s = ejkernel.explain("flash_attention", q, k, v)
    assert (s.source, s.origin, s.config) == ("memory", "autotune", tuned.config)


def test_default_applies_to_the_executor_given(toy):
    q, k, v = qkv()
    ex = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    result = autotune_recorded([record()], executor=ex)
    (tuned,) = result
    assert ex.selector.cache.entry(tuned.key).config == tuned.config
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"


def test_save_and_export_write_what_the_persistent_cache_writes(toy, tmp_path):
    q, k, v = qkv()
    result = autotune_recorded([record(), record(grad=True)], apply=False)
    assert len(result) == 2
    assert result.save() == 2
    ejkernel._executor._default = None  # a fresh process, in effect
    s = ejkernel.explain("flash_attention", q, k, v)
    assert (s.source, s.origin) == ("persistent", "autotune")
    assert ejkernel.explain("flash_attention", q, k, v, grad=True).source == "persistent"

    exported, through_cache = tmp_path / "result.json", tmp_path / "cache.json"
    assert result.export(exported) == 2
    PersistentCache().export(through_cache)

    def strip(path):
        doc = json.loads(path.read_text())
        for entry in doc["entries"].values():
            del entry["created"]
        return doc

    assert strip(exported) == strip(through_cache)
    loaded = AutotuneResult.load(exported)
    assert {(c.key, c.config, c.grad) for c in loaded} == {
        (c.key, c.config, c.grad) for c in result
    }
    assert {c.key: dict(c.timings_ms) for c in loaded} == {
        c.key: dict(c.timings_ms) for c in result
    }
    other = PersistentCache(tmp_path / "elsewhere")
    assert other.import_(exported) == 2 and set(other.entries()) == set(result.keys())
    with pytest.raises(ValueError, match="cannot load"):
        AutotuneResult.load(tmp_path / "missing.json")


def two_platforms(toy) -> None:
    def pause() -> np.ndarray:
        time.sleep(0.003)
        return np.zeros((), np.float32)

    def flash_attention_slow(*, cfg: Any, **kw: Any) -> jax.Array:
        out = flash_attention_reference(**kw)  # the same result, 3 ms later
        return out + jax.pure_callback(pause, jax.ShapeDtypeStruct((), jnp.float32))

    @hookimpl
    def ejkernel_api_version() -> int:
        return 1

    @hookimpl
    def ejkernel_register(registry: Any) -> None:
        toy.register_flash_attention(
            registry,
            flash_attention_slow,
            platform="slow",
            priority=90,
            config_space=toy.config_space,
        )

    plugin = types.SimpleNamespace(
        ejkernel_api_version=ejkernel_api_version, ejkernel_register=ejkernel_register
    )
    register_plugin(plugin, name="slow")


def test_platforms_all_tunes_each_and_remembers_the_fastest(toy, tmp_path):
    two_platforms(toy)
    q, k, v = qkv()
    assert ejkernel.explain("flash_attention", q, k, v).platform == "slow"  # by priority
    only = autotune_recorded([record()], apply=False)
    assert [c.platform for c in only] == ["slow"] and not only.platforms

    result = autotune_recorded([record()], platforms="all", apply=False)
    assert sorted(c.platform for c in result) == ["slow", "toy"]
    (choice,) = result.platforms.values()
    assert choice.platform == "toy" and set(choice.timings_ms) == {"slow", "toy"}
    assert choice.timings_ms["toy"] < choice.timings_ms["slow"]
    entries = result.entries()
    assert entries[choice.key]["source"] == "platform-choice"
    assert entries[choice.key]["config"] == "toy"

    result.apply()
    s = ejkernel.explain("flash_attention", q, k, v)
    assert s.platform == "toy" and "platform choice" in s.reason and s.source == "memory"
    picked = autotune_recorded([record()], platforms=["toy"], apply=False)
    assert [c.platform for c in picked] == ["toy"]

    result.export(tmp_path / "r.json")
    loaded = AutotuneResult.load(tmp_path / "r.json")
    assert loaded.platforms[choice.key].platform == "toy"


# -- failures, threads, timing --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Cfg:
    mode: str


class Flaky(Kernel[Cfg, jax.Array]):
    """`good` and `good2` are right, `wrong` is wrong, `broken` does not trace."""

    def __init__(self, name: str = "flaky", modes: tuple[str, ...] = ("broken", "wrong", "good2")):
        super().__init__(name=name)
        self.modes = modes

    def run(self, x, *, cfg):
        if cfg.mode.startswith("broken"):
            raise RuntimeError(f"cannot compile {cfg.mode}")
        return x * (3.0 if cfg.mode == "wrong" else 2.0)

    def heuristic_cfg(self, inv: Invocation) -> Cfg:
        return Cfg(mode="good" if "good2" in self.modes else self.modes[0])

    def config_space(self, inv: Invocation) -> list[Cfg]:
        return [Cfg(mode=m) for m in self.modes]


def test_a_failing_candidate_is_skipped_with_a_warning_never_aborting_the_batch(toy):
    x = jnp.arange(12.0).reshape(3, 4)
    flaky, dead = Flaky(), Flaky("dead", ("broken", "broken2"))
    invocations = [
        Invocation(kernel=flaky, args=(x,)),
        Invocation(kernel=dead, args=(x,)),
        record(),
        (flaky, Invocation(kernel=None, args=(jnp.ones((5, 2)),))),  # record_invocation's pair
    ]
    with pytest.warns(AutotuneWarning) as caught:
        result = autotune_recorded(invocations, max_workers=2, apply=False)
    messages = [str(w.message) for w in caught]
    assert any("broken" in m and "compile" in m for m in messages)
    assert any("wrong result" in m for m in messages)
    assert any("dead" in m and "all failed" in m for m in messages)
    assert sorted(c.op for c in result) == ["flaky", "flaky", "flash_attention"]
    assert {c.config.mode for c in result if c.op == "flaky"} <= {"good", "good2"}
    stages = {(f.op, f.stage) for f in result.failures}
    assert {("flaky", "compile"), ("flaky", "wrong result"), ("dead", "all failed")} <= stages
    # the key is the one the executor's call of the kernel looks up
    ex = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    result.apply(ex)
    assert ex(flaky, x) is not None
    flaky_keys = {c.key for c in result if c.op == "flaky"}
    assert flaky_keys <= set(ex.selector.cache)


def test_bad_arguments_are_errors_naming_them(toy):
    with pytest.raises(ValueError, match="platforms"):
        autotune_recorded([record()], platforms="nope")
    with pytest.raises(ValueError, match="max_workers"):
        autotune_recorded([record()], max_workers=0)
    with pytest.raises(TypeError, match="invocations"):
        autotune_recorded([object()])


def test_a_record_that_cannot_be_prepared_is_reported_and_skipped(toy):
    bad = RecordedInvocation(op="flash_attention", static={"causal": False})  # no arrays
    with pytest.warns(AutotuneWarning, match="record"):
        result = autotune_recorded([bad, record()], apply=False)
    assert len(result) == 1 and [f.stage for f in result.failures] == ["record"]


class Sleepy(Flaky):
    """Every candidate is right; tracing one takes a while and notes its thread."""

    threads: ClassVar[list[str]] = []

    def run(self, x, *, cfg):
        Sleepy.threads.append(threading.current_thread().name)
        time.sleep(0.05)
        return x * 2.0


def test_compiles_run_on_several_threads_and_timings_one_at_a_time(toy, monkeypatch):
    spans: list[tuple[str, float, float]] = []
    timed = _batch_tune.time_candidate

    def recording_benchmark(*args, **kwargs):
        start = time.perf_counter()
        try:
            return timed(*args, **kwargs)
        finally:
            spans.append((threading.current_thread().name, start, time.perf_counter()))

    monkeypatch.setattr(_batch_tune, "time_candidate", recording_benchmark)
    Sleepy.threads = []
    kernels = [Sleepy(f"sleepy{i}", ("a", "b", "c")) for i in range(2)]
    invocations = [Invocation(kernel=k, args=(jnp.ones((4, 4)),)) for k in kernels]
    result = autotune_recorded(invocations, max_workers=3, apply=False)
    assert len(result) == 2 and not result.failures
    assert len(Sleepy.threads) == 6
    assert all(name.startswith("ejkernel-compile") for name in Sleepy.threads)
    assert len(set(Sleepy.threads)) >= 2
    assert len(spans) >= 6  # each candidate, then the finalists again
    assert {name for name, _, _ in spans} == {threading.current_thread().name}
    spans.sort(key=lambda s: s[1])
    assert all(a[2] <= b[1] for a, b in itertools.pairwise(spans))


def phase_lines(caplog: Any, monkeypatch: Any, run: Any) -> str:
    import logging

    from ejkernel._autotune import progress_logger

    monkeypatch.setattr(progress_logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="ejkernel.progress"):
        run()
    return caplog.text


def tune_with_worker_processes(caplog: Any, monkeypatch: Any) -> tuple[Any, str]:
    """``autotune_recorded`` of :func:`record` compiling on two worker processes: the result
    and the progress lines it logged."""
    runs = []
    text = phase_lines(
        caplog,
        monkeypatch,
        lambda: runs.append(
            autotune_recorded([record()], max_workers=2, compile_processes=True, apply=False)
        ),
    )
    (result,) = runs
    return result, text


def test_compile_worker_processes_compile_what_threads_compile(monkeypatch, caplog):
    """Every candidate but the first (the reference) compiles in a worker process (its own
    GIL) and is timed here; the tuned configs are those the threads tune."""
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # the workers' compiles
    rec = record((1, 256, 2, 16))
    results = {}

    def tune(processes: bool) -> None:
        results[processes] = autotune_recorded(
            [rec], max_workers=2, compile_processes=processes, apply=False
        )

    text = phase_lines(caplog, monkeypatch, lambda: tune(True))
    tune(False)
    (tuned,) = results[True]
    (threads,) = results[False]
    assert not results[True].failures and tuned.key == threads.key
    assert set(tuned.timings_ms) == set(threads.timings_ms) and len(tuned.timings_ms) > 1
    n = len(tuned.timings_ms)
    assert "compiling on 2 worker processes" in text
    assert f"compiled {n}/{n} candidates ({n - 1} in worker processes)" in text  # not the first


def test_what_a_worker_cannot_rebuild_compiles_in_this_process(toy, monkeypatch, caplog):
    """The toy plugin is registered in this process only: the workers find no such platform,
    so its candidates compile here, and the batch tunes as with threads."""
    result, text = tune_with_worker_processes(caplog, monkeypatch)
    assert len(result) == 1 and not result.failures
    assert "compiled 3/3 candidates (0 in worker processes)" in text


def test_a_workers_executable_that_disagrees_is_judged_by_this_process_compile(
    toy, monkeypatch, caplog
):
    """Workers hand back executables whose results are off by one: each such candidate is
    compiled again here and tuned on that; the first candidate (the reference) never comes
    from a worker."""
    from ejkernel import _compile_workers

    asked = []

    def off_by_one(self, call, platforms, grad, platform, index, label):
        asked.append(index)
        targets = _batch_tune.worker_targets(pickle.loads(call), platforms, grad)
        (target,) = [t for t in targets if t.platform == platform]
        compiled, shapes = target.compile_here(index)
        return (lambda *a: jax.tree_util.tree_map(lambda x: x + 1, compiled(*a))), shapes

    monkeypatch.setattr(_compile_workers.WorkerPool, "compile", off_by_one)
    result, text = tune_with_worker_processes(caplog, monkeypatch)
    (tuned,) = result
    assert not result.failures and len(tuned.timings_ms) == 3
    assert sorted(asked) == [1, 2]
    assert "compiled 3/3 candidates (2 in worker processes)" in text
    assert "2 recompiled here" in text


def test_a_candidate_that_runs_long_is_named_and_each_time_logged_on_request(
    toy, monkeypatch, caplog
):
    timed = _batch_tune.time_candidate

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return timed(*args, **kwargs)

    monkeypatch.setattr(_batch_tune, "time_candidate", slow)
    monkeypatch.setattr(_batch_tune, "STUCK_AFTER_S", 0.05)
    monkeypatch.setenv("EJKERNEL_LOG_AUTOTUNE", "1")
    text = phase_lines(
        caplog, monkeypatch, lambda: autotune_recorded([record()], max_workers=2, apply=False)
    )
    assert text.count("still running after") >= 3  # each candidate once (caplog may repeat)
    assert text.count(" ms\n") >= 3 and "flash_attention/toy {" in text


def test_duplicates_are_tuned_once_and_none_means_every_recorded_invocation(toy, monkeypatch):
    from ejkernel import _recording

    monkeypatch.setattr(_recording, "get_invocations", lambda: [record(), record()])
    result = autotune_recorded(apply=False)
    assert len(result) == 1


def test_progress_bar_and_phase_lines(toy, capsys, caplog, monkeypatch):
    text = phase_lines(
        caplog, monkeypatch, lambda: autotune_recorded([record()], progress=True, apply=False)
    )
    assert "compiling on" in text and "compiled 3/3" in text and "timed 3" in text
    assert "compiling" in capsys.readouterr().err  # tqdm's bar


# -- the seed ---------------------------------------------------------------------------------


#: The seed's batch-tuning example: its kernel (``_seed_kernel.py``), then its calls.
SEED_BATCH_AUTOTUNING = (
    pathlib.Path(__file__).with_name("_seed_kernel.py").read_text()
    + """
kernel = MyKernel()
a, b = jnp.ones((16, 8)), jnp.ones((8, 4))
inv = Invocation(kernel=kernel, args=(a, b))

from ejkernel.ops import autotune_recorded, record_invocation, get_invocations
# Enable recording
record_invocation(kernel, inv)
# ... run your model with various inputs ...
# Get all recorded invocations
invocations = get_invocations()
# Autotune all at once
results = autotune_recorded(invocations)
print(sorted(c.op for c in results), results.failures)
"""
)


@pytest.mark.skipif(
    not hasattr(ejkernel.ops, "record_invocation"),
    reason="record_invocation and get_invocations come with recording (ejkernel._recording)",
)
def test_seed_batch_autotuning_example_runs_as_written(tmp_path):
    # in a child process: what recording keeps stays there
    out = run_python(["-c", SEED_BATCH_AUTOTUNING], str(tmp_path / "cache"))
    assert out.strip() == "['my_kernel'] []"


def test_with_result_nests_per_thread(toy):
    q, k, v = qkv()
    result = autotune_recorded([record()], apply=False)
    barrier = threading.Barrier(2)
    seen: list[str] = []

    def use(first: bool) -> None:
        with result:
            barrier.wait()  # both inside
            seen.append(ejkernel.explain("flash_attention", q, k, v).source)
            if first:
                return  # leaves while the other thread is still inside
            time.sleep(0.05)
        seen.append(ejkernel.explain("flash_attention", q, k, v).source)

    threads = [threading.Thread(target=use, args=(i == 0,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == ["heuristic", "overlay", "overlay"]
