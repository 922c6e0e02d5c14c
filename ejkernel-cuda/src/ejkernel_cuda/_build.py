"""Build the native CUDA kernels with nvcc on first use, cache them, load them into XLA.

The sources in ``ejkernel_cuda/csrc`` are compiled for one architecture (the device's compute
capability) against ``jax.ffi.include_dir()``, one object per ``.cu`` file in parallel, then
linked into ``libejkernel_cuda.so``. The result lives in ``<cache>/cuda/<key>/`` where
``<cache>`` is ejkernel's cache folder (``EJKERNEL_CACHE_DIR``) and ``<key>`` hashes the
sources, the architecture, the jax/jaxlib versions, nvcc's version and the flags, so any change
rebuilds. Concurrent processes build once: the build runs under an OS file lock
(``<key>.lock``) in a temporary folder that is renamed into place when complete. A failed
build leaves ``<key>.failed`` holding the compiler's message, reported (not retried) until
the toolchain or the sources change, or ``ejkernel build cuda --force`` asks again.

:func:`native_status` is what the native implementations' ``supports()`` consult: ``True``
once the library is built, loaded and its FFI targets registered (once per process), else
the reason, with the compiler's message.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "LIBRARY",
    "TARGETS",
    "BuildError",
    "build",
    "build_key",
    "compile_command",
    "find_nvcc",
    "native_status",
    "normalize_arch",
    "require_native",
    "source_files",
    "status",
]

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
LIBRARY = "libejkernel_cuda.so"

#: FFI target name -> exported handler symbol (XLA_FFI_DEFINE_HANDLER_SYMBOL in csrc/).
TARGETS: dict[str, str] = {
    "ejkernel_decode_attention": "EjkDecodeAttention",
    "ejkernel_mean_pooling_fwd": "EjkMeanPoolingFwd",
    "ejkernel_mean_pooling_bwd": "EjkMeanPoolingBwd",
}

#: nvcc flags besides the architecture, the include folder and the output (part of the key).
FLAGS = (
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-Wno-return-type",
    "-diag-suppress=940,2473",
)

#: Seconds one nvcc invocation may take.
COMPILE_TIMEOUT = 900


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries the compiler's output."""


def find_nvcc() -> str | None:
    """nvcc on ``PATH``, else under ``$CUDA_HOME``/``$CUDA_PATH``, else ``/usr/local/cuda``."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def nvcc_version(nvcc: str) -> str:
    """The release line of ``nvcc --version`` (part of the build key)."""
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"cannot run {nvcc} --version: {err}") from err
    lines = [line for line in out.splitlines() if "release" in line] or out.splitlines()[-1:]
    return lines[0].strip() if lines else "unknown"


def normalize_arch(arch: str | None) -> str:
    """``"9.0"``, ``"90"``, ``"sm_90"`` or ``"sm_90a"`` -> ``"90"`` / ``"90a"``.

    Raises:
        BuildError: when ``arch`` is ``None`` and no NVIDIA GPU says its compute capability,
            or it cannot be read.
    """
    if arch is None:
        from ejkernel_cuda._device import compute_capability

        arch = compute_capability()
        if arch is None:
            raise BuildError(
                "no NVIDIA GPU is visible to tell the compute capability; pass one "
                "(`ejkernel build cuda --target 90`)"
            )
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("compute_")
    if "." in text:
        major, _, minor = text.partition(".")
        text = f"{major}{minor}"
    digits = text.rstrip("a").rstrip("f")
    if not digits.isdigit() or len(digits) < 2:
        raise BuildError(f"cannot read a compute capability from {arch!r} (expected e.g. 90)")
    return text


def source_files() -> list[Path]:
    """The CUDA sources shipped as package data, sorted."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh"))


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("jax", "jaxlib"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "?"
    return out


def build_key(arch: str, nvcc_release: str) -> str:
    """Hash of the sources, the architecture, jax/jaxlib and nvcc versions and the flags."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    meta = {"arch": arch, "nvcc": nvcc_release, "flags": FLAGS, **_versions()}
    digest.update(json.dumps(meta, sort_keys=True).encode())
    return digest.hexdigest()[:20]


def _include_dir() -> str:
    import jax.ffi

    return str(jax.ffi.include_dir())


def compile_command(nvcc: str, source: Path, obj: Path, arch: str) -> list[str]:
    """nvcc command line compiling one ``.cu`` file to an object for ``sm_<arch>``."""
    return [
        nvcc,
        *FLAGS,
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-I{_include_dir()}",
        f"-I{CSRC}",
        "-c",
        str(source),
        "-o",
        str(obj),
    ]


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands in parallel; raise BuildError with the failing ones' output."""
    procs = [
        (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for cmd in commands
    ]
    failures = []
    for cmd, proc in procs:
        try:
            out, _ = proc.communicate(timeout=COMPILE_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = f"timed out after {COMPILE_TIMEOUT} s"
        if proc.returncode != 0:
            failures.append(f"$ {' '.join(cmd)}\n{_error_lines(out)}")
    if failures:
        raise BuildError("nvcc failed:\n" + "\n".join(failures))


def _error_lines(output: str, limit: int = 4000) -> str:
    """The compiler's errors first (warnings from the XLA headers are noise), then the tail."""
    lines = output.splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    text = "\n".join(errors or lines)
    return text[-limit:]


def cache_root(root: str | os.PathLike[str] | None = None) -> Path:
    """``<ejkernel cache folder>/cuda`` (read at each call, as the core reads it)."""
    if root is not None:
        return Path(root)
    from ejkernel.ops import PersistentCache

    return Path(PersistentCache().directory) / "cuda"


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _cached_failure(path: Path) -> str:
    return f"{path.read_text()} [cached failure: `ejkernel build cuda --force` retries]"


def build(
    *,
    arch: str | None = None,
    root: str | os.PathLike[str] | None = None,
    force: bool = False,
    nvcc: str | None = None,
) -> Path:
    """Build (or find in the cache) the shared library; returns its path.

    Args:
        arch: compute capability (``"90"``, ``"9.0"``); default the default device's.
        root: the folder holding builds; default ``<ejkernel cache folder>/cuda``.
        force: rebuild even over a cached build or a cached failure.
        nvcc: the compiler; default :func:`find_nvcc`.

    Raises:
        BuildError: nvcc is missing or failed (its output in the message).
    """
    arch = normalize_arch(arch)
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(
            "nvcc not found (looked on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); install the "
            "CUDA toolkit to build the native kernels"
        )
    key = build_key(arch, nvcc_version(nvcc))
    base = cache_root(root)
    final = base / key
    library = final / LIBRARY
    failed = base / f"{key}.failed"
    if not force:
        if library.is_file():
            return library
        if failed.is_file():
            raise BuildError(_cached_failure(failed))
    base.mkdir(parents=True, exist_ok=True)
    from ejkernel.ops import file_lock

    with file_lock(base / f"{key}.lock"):
        if not force:  # another process may have finished while we waited
            if library.is_file():
                return library
            if failed.is_file():
                raise BuildError(_cached_failure(failed))
        work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=base))
        try:
            start = time.perf_counter()
            _compile_into(work, nvcc, arch)
            meta = {
                "arch": arch,
                "nvcc": nvcc,
                "sources": [p.name for p in source_files()],
                "seconds": round(time.perf_counter() - start, 1),
                **_versions(),
            }
            (work / "build.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            for obj in work.glob("*.o"):
                obj.unlink()
            work.chmod(0o755)  # mkdtemp makes it private; a shared cache is read by others
            if final.exists():
                shutil.rmtree(final)
            os.rename(work, final)  # atomic: readers see a complete folder or none
        except BuildError as err:
            _write_atomic(failed, f"{err} (sm_{arch}, key {key})")
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        failed.unlink(missing_ok=True)
        log.info("built %s for sm_%s in %.1f s", library, arch, time.perf_counter() - start)
    return library


def _compile_into(work: Path, nvcc: str, arch: str) -> None:
    units = [p for p in source_files() if p.suffix == ".cu"]
    objects = [work / f"{p.stem}.o" for p in units]
    _run_all([compile_command(nvcc, src, obj, arch) for src, obj in zip(units, objects)])
    # The CUDA runtime is linked statically (nvcc's default): the library needs no libcudart on
    # the loader path; streams and memory come from XLA through the FFI.
    link = [nvcc, "-shared", "-o", str(work / LIBRARY), *map(str, objects)]
    _run_all([link])


def status(*, arch: str | None = None, root: str | os.PathLike[str] | None = None) -> str:
    """The state of the build for ``arch``, without building: built, failed, or not yet."""
    nvcc = find_nvcc()
    if nvcc is None:
        return "unavailable: nvcc not found (install the CUDA toolkit)"
    try:
        arch = normalize_arch(arch)
        key = build_key(arch, nvcc_version(nvcc))
    except BuildError as err:
        return f"unknown: {err}"
    base = cache_root(root)
    if (base / key / LIBRARY).is_file():
        return f"built for sm_{arch}: {base / key / LIBRARY}"
    if (base / f"{key}.failed").is_file():
        return f"failed for sm_{arch}: {(base / f'{key}.failed').read_text()}"
    return f"not built yet for sm_{arch} (built on first use, or `ejkernel build cuda`)"


# -- loading into this process ---------------------------------------------------------------

_state_lock = threading.Lock()
_state: dict[str, Any] = {}


def _register_targets(library: Path) -> Any:
    import jax.ffi

    lib = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(
            target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA"
        )
    return lib


def native_status() -> bool | str:
    """``True`` once the kernels are built, loaded and registered with XLA (once per process,
    building on first use); else why not, with the compiler's message."""
    with _state_lock:
        if "status" not in _state:
            try:
                _state["lib"] = _register_targets(build())
                _state["status"] = True
            except BuildError as err:
                _state["status"] = f"native CUDA kernels unavailable: {err}"
            except Exception as err:  # loading or registering failed
                _state["status"] = (
                    f"native CUDA kernels unavailable: loading the library failed: "
                    f"{type(err).__name__}: {err}"
                )
        return _state["status"]  # type: ignore[no-any-return]


def require_native() -> None:
    """Raise ``RuntimeError`` with :func:`native_status`'s reason unless the kernels are ready
    (``supports()`` has said so already; this guards direct calls)."""
    ready = native_status()
    if ready is not True:
        raise RuntimeError(str(ready))
