"""Compile worker processes for batch tuning.

Tracing and lowering a kernel candidate are Python work that holds the GIL, so compile threads
of one process share one core for that part (measured on a GPU: 8 threads compile a batch of
Pallas flash-attention candidates only 2.1x faster than one). A worker process has a GIL of its
own: it rebuilds the tuning target of a recorded call (which pickles: op name and abstract
arguments, never a closure), compiles one candidate, and sends back the serialized executable,
which the tuning process loads and times. Workers run ``python -m ejkernel._compile_workers``
with the parent's ``sys.path`` and environment (device memory not preallocated); they never run
the user's ``__main__``.

The parent falls back to compiling a candidate itself whenever a worker cannot serve it: the
call does not pickle, the worker's registry builds other candidates (a plugin registered in the
parent process only), the executable does not serialize, the worker died, or the candidate
failed to compile there (a worker shares the device's memory with the tuning process, and XLA's
own autotuning inside a compile can run out of it): the parent's compile decides.

Protocol on the worker's stdin/stdout: length-prefixed pickles. First message ``sys.path``; then
``(call, platforms, grad, platform, index, label)`` per task, ``None`` to stop. Replies:
``("ok", serialized, in_tree, out_tree, shapes)``, ``("failed", error)`` or
``("unavailable", why)``. The worker's own prints go to its stderr.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

__all__ = ["WorkerPool", "WorkerUnavailable"]


class WorkerUnavailable(Exception):
    """A worker cannot serve this candidate; the parent compiles it itself."""


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("compile worker closed its pipe")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("compile worker closed its pipe")
    return pickle.loads(data)


class _Worker:
    """One worker process, used by one thread at a time."""

    def __init__(self) -> None:
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("EJKERNEL_OPS_RECORD", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ejkernel._compile_workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        _send(self.stdin, list(sys.path))

    def ask(self, task: tuple[Any, ...]) -> Any:
        _send(self.stdin, task)
        return _receive(self.stdout)

    def stop(self) -> None:
        try:
            _send(self.stdin, None)
            self.stdin.close()
            self.process.wait(timeout=10)
        except Exception:
            self.process.kill()
            self.process.wait()
        finally:
            self.stdout.close()


class WorkerPool:
    """Worker processes started on demand, one per calling thread."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def _worker(self) -> _Worker | None:
        worker = getattr(self._local, "worker", False)
        if worker is False:
            try:
                worker = _Worker()
            except OSError:
                worker = None
            self._local.worker = worker
            if worker is not None:
                with self._lock:
                    self._workers.append(worker)
        return worker

    def compile(
        self, call: bytes, platforms: Any, grad: Any, platform: str, index: int, label: str
    ) -> tuple[Any, tuple[Any, ...]]:
        """``(compiled, abstract arguments)`` of candidate ``index`` of ``call`` on ``platform``.

        Raises :class:`WorkerUnavailable` where the parent must compile it: also where it
        failed to compile in the worker, so that this process's compile decides."""
        worker = self._worker()
        if worker is None:
            raise WorkerUnavailable("no worker process")
        try:
            reply = worker.ask((call, platforms, grad, platform, index, label))
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            self._local.worker = None
            worker.stop()
            raise WorkerUnavailable(f"worker lost: {err}") from err
        if reply[0] == "unavailable":
            raise WorkerUnavailable(reply[1])
        if reply[0] == "failed":  # out of device memory beside the tuning process, say
            raise WorkerUnavailable(f"failed in the worker: {reply[1]}")
        _, serialized, in_tree, out_tree, shapes = reply
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            return deserialize_and_load(serialized, in_tree, out_tree), shapes
        except Exception as err:
            raise WorkerUnavailable(f"executable did not load: {err}") from err

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()


def _serve(prepare: Callable[[Any, Any, Any], list[Any]]) -> None:
    """The worker's loop; ``prepare(call, platforms, grad)`` gives the call's targets."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    source = sys.stdin.buffer
    sys.path[:] = _receive(source)
    import jax
    from jax.experimental.serialize_executable import serialize

    from ejkernel._json import stable_json

    targets: dict[tuple[bytes, Any, Any], list[Any]] = {}
    while True:
        task = _receive(source)
        if task is None:
            return
        call, platforms, grad, platform, index, label = task
        try:
            key = (call, str(platforms), grad)
            if key not in targets:
                targets[key] = prepare(pickle.loads(call), platforms, grad)
            target = next(t for t in targets[key] if t.platform == platform)
            cfg = target.configs[index]
            if stable_json(cfg) != label:
                raise ValueError(f"candidate {index} is {stable_json(cfg)} here, not {label}")
        except Exception as err:
            _send(out, ("unavailable", f"{type(err).__name__}: {err}"))
            continue
        try:
            fn, shapes = target.function(cfg)
            compiled = jax.jit(fn).lower(*shapes).compile()
        except Exception as err:
            _send(out, ("failed", f"{type(err).__name__}: {err}"))
            continue
        try:
            serialized, in_tree, out_tree = serialize(compiled)
            _send(out, ("ok", serialized, in_tree, out_tree, shapes))
        except Exception as err:
            _send(out, ("unavailable", f"not serializable: {type(err).__name__}: {err}"))


if __name__ == "__main__":
    from ejkernel._batch_tune import worker_targets

    _serve(worker_targets)
