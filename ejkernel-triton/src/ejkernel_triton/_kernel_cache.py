"""An on-disk cache of the kernels jax-triton compiles, so a new process skips Triton's compiler.

jax-triton compiles a kernel (Triton source → TTIR → TTGIR → LLVM IR → PTX) while JAX lowers
the call, and keeps the result in a dictionary that dies with the process: every new process
pays about two seconds per kernel (three kernels for a flash-attention forward and backward).
:func:`install` wraps jax-triton's ``get_or_create_triton_kernel`` so the PTX, the kernel name,
its shared memory and the argument attributes are also written to
``<ejkernel cache folder>/triton/<key>.json`` and read back from there.

The key hashes everything that can change the compiler's output: the kernel's source and the
sources of the functions it calls (Triton's own ``JITFunction.cache_key``), the argument types
and attributes, the constexprs, warps, stages, CTAs, compute capability, fp fusion, and the
versions of triton, jax-triton and jaxlib. CUDA only (on ROCm jax-triton passes a file path,
not the code).

Gluon kernels (``@gluon.jit``, Triton's lower-level language) take the same road: jax-triton
would build them as Triton IR, which they are not, so the wrapper compiles them itself
(:func:`_compile_gluon`) and hands jax-triton's launcher the same kind of kernel object.

A file that cannot be read or parsed is ignored with a warning and compiled again; a folder
that cannot be written gives one warning and the process goes on with the in-memory cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
import types
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from ejkernel import _env

__all__ = ["cache_folder", "install"]

_installed = False
_install_lock = threading.Lock()
_captured = threading.local()
_warned_unwritable = False
_memory: dict[str, Any] = {}


def cache_folder() -> Path:
    """``<ejkernel cache folder>/triton`` (read at each call, like the core's caches)."""
    return _env.cache_dir() / "triton"


def install() -> None:
    """Wrap jax-triton's compilation with the disk cache (idempotent, once per process)."""
    global _installed
    if _installed:  # every launch asks; only the first takes the lock
        return
    with _install_lock:
        if _installed:
            return
        from jax_triton import triton_lib

        triton_lib.compile_ttir_inplace = _capturing(triton_lib.compile_ttir_inplace)
        triton_lib.get_or_create_triton_kernel = _cached(triton_lib.get_or_create_triton_kernel)
        _installed = True


def _capturing(compile_fn: Any) -> Any:
    """Keep the TTIR and the compilation result of this thread's latest compile."""

    @functools.wraps(compile_fn)
    def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
        ttir = str(module)
        result = compile_fn(module, *args, **kwargs)
        _captured.last = (ttir, result)
        return result

    return wrapper


def _cached(get_or_create: Any) -> Any:
    @functools.wraps(get_or_create)
    def wrapper(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
        from jax_triton import triton_lib

        if platform != "cuda":
            return get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)
        if kw.get("compute_capability") is None:
            kw["compute_capability"] = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
        key = _key(fn, arg_dtypes, scalar_args, kw)
        if key in _memory:  # already compiled or read in this process
            return _memory[key]
        path = cache_folder() / f"{key}.json"
        entry = _read(path)
        if entry is not None:
            kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
                entry["name"],
                kw.get("num_warps") or 4,
                kw["num_ctas"],
                entry["shared_mem_bytes"],
                entry["ptx"],
                entry["ttir"],
                kw["compute_capability"],
            )
            _memory[key] = kernel, {(i,): attr for i, attr in entry["attrs"]}
            return _memory[key]
        _captured.last = None
        if _is_gluon(fn):
            kernel, attrs = _compile_gluon(fn, arg_dtypes, scalar_args, **kw)
        else:
            kernel, attrs = get_or_create(
                backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw
            )
        _memory[key] = kernel, attrs
        captured = getattr(_captured, "last", None)
        if captured is not None:
            ttir, result = captured
            _write(
                path,
                {
                    "name": result.name,
                    "shared_mem_bytes": result.shared_mem_bytes,
                    "ptx": result.binary,
                    "ttir": ttir,
                    "attrs": [[i[0], attr] for i, attr in attrs.items()],
                },
            )
        return kernel, attrs

    return wrapper


def _is_gluon(fn: Any) -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:  # a Triton without Gluon
        return False
    return isinstance(fn, GluonJITFunction)


def _compile_gluon(
    fn: Any, arg_dtypes: Any, scalar_args: Any, **kw: Any
) -> tuple[Any, dict[tuple[int], list[Any]]]:
    """Compile a Gluon kernel for jax-triton's launcher.

    jax-triton builds its kernels from Triton IR (``ASTSource``); a Gluon kernel's source lowers
    straight to TritonGPU IR, so it goes through ``triton.compile`` with a ``GluonASTSource``
    instead. The launch contract is jax-triton's: arrays 16-byte aligned, integers equal to 1
    folded into constants (and not passed), the same trailing scratch parameters.
    """
    import triton
    from jax_triton import triton_lib
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    scalars = {i for i, _, _ in scalar_args}
    signature = {fn.arg_names[i]: t for i, t in enumerate(arg_dtypes)}
    constexprs = dict(kw.get("metaparams") or {})
    constexprs.update({fn.arg_names[i]: 1 for i, _, v in scalar_args if v == 1})
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = {
        (i,): ([] if i in scalars else [["tt.divisibility", 16]]) for i in range(len(arg_dtypes))
    }
    num_warps = kw.get("num_warps") or 4
    source = GluonASTSource(
        fn, signature, constexprs=constexprs, attrs={k: v for k, v in attrs.items() if v}
    )
    # jax-triton switches Triton's own cache off (TRITON_CACHE_DIR=""), and triton.compile
    # needs one: a throwaway folder (the PTX goes to this module's cache below)
    with (
        tempfile.TemporaryDirectory(prefix="ejkernel-gluon-") as scratch,
        triton.knobs.cache.scope(),
    ):
        triton.knobs.cache.dir = scratch
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", kw["compute_capability"], 32),
            options={"num_warps": num_warps, "num_ctas": kw.get("num_ctas") or 1},
        )
    result = types.SimpleNamespace(
        name=compiled.metadata.name,
        shared_mem_bytes=compiled.metadata.shared,
        binary=compiled.asm["ptx"],
    )
    _captured.last = ("", result)
    kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
        result.name,
        num_warps,
        kw.get("num_ctas") or 1,
        result.shared_mem_bytes,
        result.binary,
        "",
        kw["compute_capability"],
    )
    return kernel, attrs


def _key(fn: Any, arg_dtypes: Any, scalar_args: Any, kw: dict[str, Any]) -> str:
    """A hex digest of everything that decides the compiled code (see the module docstring)."""
    parts = [
        fn.cache_key,  # source of the kernel and of every function it calls
        tuple(arg_dtypes),
        tuple((i, name, value) for i, name, value in scalar_args if value in (None, 1)),
        tuple(i for i, _, _ in scalar_args),
        tuple(sorted((k, repr(v)) for k, v in kw.get("metaparams", {}).items())),
        kw.get("num_warps") or 4,
        kw.get("num_stages") or 3,
        kw.get("num_ctas"),
        kw.get("compute_capability"),
        kw.get("enable_fp_fusion"),
        bool(kw.get("dump")),
        _versions(),
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@functools.cache
def _versions() -> tuple[str, ...]:
    out = []
    for dist in ("triton", "jax-triton", "jaxlib"):
        try:
            out.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist}=?")
    return tuple(out)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        warnings.warn(f"ejkernel-triton: cannot read kernel cache {path}: {err}", stacklevel=3)
        return None
    try:
        entry = json.loads(text)
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("ptx"), str)
            and isinstance(entry.get("ttir"), str)
            and isinstance(entry.get("shared_mem_bytes"), int)
            and isinstance(entry.get("attrs"), list)
        ):
            raise ValueError("missing or mistyped fields")
        return entry
    except ValueError as err:
        warnings.warn(
            f"ejkernel-triton: ignoring corrupt kernel cache file {path} ({err}); compiling again",
            stacklevel=3,
        )
        return None


def _write(path: Path, entry: dict[str, Any]) -> None:
    """Atomic write (temporary file, then rename); an unwritable folder warns once."""
    global _warned_unwritable
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not _warned_unwritable:
            _warned_unwritable = True
            warnings.warn(
                f"ejkernel-triton: cannot write the kernel cache in {path.parent}: {err}; "
                "kernels will be compiled again in the next process",
                stacklevel=3,
            )
