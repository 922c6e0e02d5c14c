"""An on-disk cache of the kernels jax-triton compiles, so a new process skips Triton's compiler.

jax-triton compiles a kernel (Triton source → TTIR → TTGIR → LLVM IR → PTX) while JAX lowers
the call, and keeps the result in a dictionary that dies with the process: every new process
pays about two seconds per kernel (three kernels for a flash-attention forward and backward).
:func:`install` wraps jax-triton's ``get_or_create_triton_kernel`` so the PTX, the kernel name,
its shared memory and the argument attributes are also written to
``<ejkernel cache folder>/triton/<key>.json`` and read back from there.

The key hashes everything that can change the compiler's output: the kernel's source and the
sources of the functions and constexprs it names (:func:`source_key`), the argument types
and attributes, the constexprs, warps, stages, CTAs, compute capability, fp fusion, and the
versions of triton, jax-triton and jaxlib (NumPy scalars spelled as the Python numbers they
equal). jax-triton keeps its own in-memory cache, whose keys compare by value: where it answers
a key of ours without compiling (``True`` where an earlier launch passed ``1``), the entry made
for that kernel object is written under our key as well, so the next process finds both. CUDA only (on ROCm jax-triton passes a file path,
not the code).

Gluon kernels (``@gluon.jit``, Triton's lower-level language) and kernels marked with
:func:`compile_directly` (warp-specialized ones) take the same road, but the wrapper compiles
them itself with ``triton.compile`` (:func:`_compile_direct`) and hands jax-triton's launcher the
same kind of kernel object: jax-triton would build Gluon as Triton IR, which it is not, and would
launch a warp-specialized kernel with the warps asked for, not the ones the compiler added.

A file that cannot be read or parsed is ignored with a warning and compiled again; a folder
that cannot be written gives one warning and the process goes on with the in-memory cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import types
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from ejkernel import env

__all__ = ["GLOBAL_SCRATCH_BYTES", "cache_folder", "compile_directly", "install", "source_key"]

_installed = False
_install_lock = threading.Lock()
#: Held by :func:`_compile_direct` while Triton's cache folder knob points at its scratch folder.
_direct_lock = threading.Lock()
_captured = threading.local()
_warned_unwritable = False
_memory: dict[str, Any] = {}
#: the cache entry of each kernel object this process made or read, by ``id`` (the objects live
#: in ``_memory``): jax-triton's own in-memory cache can answer a key of ours that differs only
#: in how a value is spelled, without compiling; that answer is written under our key too
_entries: dict[int, dict[str, Any]] = {}


def cache_folder() -> Path:
    """``<ejkernel cache folder>/triton`` (read at each call, like the core's caches)."""
    return env.cache_dir() / "triton"


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
                entry.get("num_warps") or kw.get("num_warps") or 4,
                kw["num_ctas"],
                entry["shared_mem_bytes"],
                entry["ptx"],
                entry["ttir"],
                kw["compute_capability"],
            )
            _memory[key] = kernel, {(i,): attr for i, attr in entry["attrs"]}
            _entries[id(kernel)] = entry
            return _memory[key]
        _captured.last = None
        gluon = _is_gluon(fn)
        if gluon or getattr(fn, "ejkernel_compile_directly", False):
            kernel, attrs = _compile_direct(fn, arg_dtypes, scalar_args, gluon=gluon, **kw)
        else:
            kernel, attrs = get_or_create(
                backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw
            )
        _memory[key] = kernel, attrs
        captured = getattr(_captured, "last", None)
        if captured is not None:
            ttir, result = captured
            _entries[id(kernel)] = {
                "name": result.name,
                "num_warps": getattr(result, "num_warps", None) or kw.get("num_warps") or 4,
                "shared_mem_bytes": result.shared_mem_bytes,
                "ptx": result.binary,
                "ttir": ttir,
                "attrs": [[i[0], attr] for i, attr in attrs.items()],
            }
        entry = _entries.get(id(kernel))  # without a capture: a hit in jax-triton's own cache
        if entry is not None:
            _write(path, entry)
        return kernel, attrs

    return wrapper


def compile_directly(fn: Any) -> Any:
    """Mark a ``@triton.jit`` kernel to be compiled by :func:`_compile_direct` (a decorator).

    For kernels that Triton warp-specializes (``tl.range(..., warp_specialize=True)``): the
    compiler adds warps (a producer and consumer warp groups), which jax-triton would not
    launch, and device-side TMA descriptors need per-program global scratch, for which
    jaxlib passes a null pointer. See :func:`_compile_direct` for the scratch contract.
    """
    fn.ejkernel_compile_directly = True
    return fn


#: bytes of global scratch per program that launchers allocate for ``GlobalScratch``
GLOBAL_SCRATCH_BYTES = 1024


def _is_gluon(fn: Any) -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return False
    return isinstance(fn, GluonJITFunction)


def _compile_direct(
    fn: Any, arg_dtypes: Any, scalar_args: Any, *, gluon: bool, **kw: Any
) -> tuple[Any, dict[tuple[int], list[Any]]]:
    """Compile a kernel with ``triton.compile`` and wrap it for jax-triton's launcher.

    Two kinds of kernels come here. Gluon kernels (``@gluon.jit``) lower straight to TritonGPU
    IR, which jax-triton's Triton-IR pipeline cannot take (``GluonASTSource``). Kernels marked
    with :func:`compile_directly` go through Triton's own driver so that the launch takes the
    warp count the compiler settled on (``metadata.num_warps``), not the one asked for.

    Global scratch: jaxlib passes a null pointer for Triton's hidden scratch parameter. A kernel
    that needs scratch (device-side TMA descriptors) declares an output ``GlobalScratch`` as its
    last runtime parameter, of :data:`GLOBAL_SCRATCH_BYTES` per program; the PTX is rewritten
    so the hidden parameter's loads read that one instead.

    The launch contract is jax-triton's: arrays 16-byte aligned, integers equal to 1 folded into
    constants (and not passed), the same two trailing hidden parameters.
    """
    import triton
    from jax_triton import triton_lib
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source

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
    options = {"num_warps": num_warps, "num_ctas": kw.get("num_ctas") or 1}
    if not gluon:
        options["num_stages"] = kw.get("num_stages") or 3
    options.update(_compile_options(fn))
    source = Source(
        fn, signature, constexprs=constexprs, attrs={k: v for k, v in attrs.items() if v}
    )
    # jax-triton switches Triton's own cache off (TRITON_CACHE_DIR=""), and triton.compile
    # needs one: a throwaway folder (the PTX goes to this module's cache below). The folder is
    # a process-wide knob, so direct compiles take turns (batch tuning compiles in threads).
    with (
        _direct_lock,
        tempfile.TemporaryDirectory(prefix="ejkernel-direct-") as scratch,
        triton.knobs.cache.scope(),
    ):
        triton.knobs.cache.dir = scratch
        compiled = triton.compile(
            source, target=GPUTarget("cuda", kw["compute_capability"], 32), options=options
        )
    ptx = compiled.asm["ptx"]
    if getattr(compiled.metadata, "global_scratch_size", 0):
        runtime = [n for n in signature if signature[n] != "constexpr"]
        ptx = _redirect_global_scratch(
            fn, ptx, compiled.metadata.name, runtime, compiled.metadata.global_scratch_size
        )
    result = types.SimpleNamespace(
        name=compiled.metadata.name,
        num_warps=compiled.metadata.num_warps,
        shared_mem_bytes=compiled.metadata.shared,
        binary=ptx,
    )
    _captured.last = ("", result)
    kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
        result.name,
        result.num_warps,
        kw.get("num_ctas") or 1,
        result.shared_mem_bytes,
        result.binary,
        "",
        kw["compute_capability"],
    )
    return kernel, attrs


def _compile_options(fn: Any) -> dict[str, Any]:
    """Extra ``triton.compile`` options a kernel asks for (``fn.ejkernel_compile_options``,
    e.g. ``{"maxnreg": 168}`` for a Gluon kernel that hands registers between partitions)."""
    return dict(getattr(fn, "ejkernel_compile_options", None) or {})


def _redirect_global_scratch(fn: Any, ptx: str, name: str, runtime: list[str], size: int) -> str:
    """Point the loads of Triton's hidden global-scratch parameter at ``GlobalScratch``."""
    if not runtime or runtime[-1] != "GlobalScratch":
        raise ValueError(
            f"kernel {fn.__name__} needs {size} bytes of global scratch per program: give it an "
            "output 'GlobalScratch' as its last runtime parameter"
        )
    if size > GLOBAL_SCRATCH_BYTES:
        raise ValueError(
            f"kernel {fn.__name__} needs {size} bytes of global scratch per program, more than "
            f"the {GLOBAL_SCRATCH_BYTES} launchers allocate"
        )
    ours, hidden = len(runtime) - 1, len(runtime)
    hidden_ref, our_ref = f"[{name}_param_{hidden}]", f"[{name}_param_{ours}]"
    if f"{name}_param_{hidden + 1}" not in ptx or hidden_ref not in ptx:
        raise RuntimeError(f"unexpected PTX parameters in {name}: cannot place global scratch")
    return ptx.replace(hidden_ref, our_ref)


def _key(fn: Any, arg_dtypes: Any, scalar_args: Any, kw: dict[str, Any]) -> str:
    """A hex digest of everything that decides the compiled code (see the module docstring)."""
    return hashlib.sha256(repr(_key_parts(fn, arg_dtypes, scalar_args, kw)).encode()).hexdigest()[
        :32
    ]


def _key_parts(fn: Any, arg_dtypes: Any, scalar_args: Any, kw: dict[str, Any]) -> list[Any]:
    return [
        source_key(fn),  # source of the kernel, of every function it calls, their constexprs
        tuple(arg_dtypes),
        tuple((i, name, _plain(v)) for i, name, v in scalar_args if v is None or v == 1),
        tuple(i for i, _, _ in scalar_args),
        tuple(sorted((k, repr(_plain(v))) for k, v in kw.get("metaparams", {}).items())),
        kw.get("num_warps") or 4,
        kw.get("num_stages") or 3,
        kw.get("num_ctas"),
        kw.get("compute_capability"),
        kw.get("enable_fp_fusion"),
        sorted(_compile_options(fn).items()),
        bool(kw.get("dump")),
        _versions(),
    ]


_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_source_keys: dict[int, tuple[Any, str]] = {}


def source_key(fn: Any) -> str:
    """A digest of a Triton or Gluon function's source and, recursively, of the functions and
    constexpr globals it names (those of Triton itself are covered by its version).

    Not Triton's ``JITFunction.cache_key``: that one depends on the order in which a process
    first asks for the keys of the kernels that share a helper (it merges a helper's globals
    before it works out the helper's own key), so a kernel launched first in one process and
    after another kernel in the next had two keys, and a warm start compiled it again.
    """
    known = _source_keys.get(id(fn))
    if known is not None and known[0] is fn:
        return known[1]
    hasher = hashlib.sha256()
    seen: set[int] = set()

    def visit(f: Any) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        src, scope = getattr(f, "src", None), getattr(f, "__globals__", None)
        if not isinstance(src, str) or not isinstance(scope, dict):
            hasher.update(repr(getattr(f, "cache_key", f)).encode())
            return
        hasher.update(f"{f.__module__}.{f.__qualname__}\n{src}\n".encode())
        for dotted in sorted(set(_NAME.findall(src))):
            head, *attrs = dotted.split(".")
            value = scope.get(head, _MISSING)
            for attr in attrs:  # module.helper
                if not isinstance(value, types.ModuleType):
                    break
                value = getattr(value, attr, _MISSING)
            if value is _MISSING or isinstance(value, types.ModuleType):
                continue
            if _is_jit(value):
                if not str(getattr(value, "__module__", "")).startswith("triton."):
                    visit(value)
            elif isinstance(value, (bool, int, float, str)) or _is_constexpr(value):
                hasher.update(f"{dotted}={getattr(value, 'value', value)!r}\n".encode())

    visit(fn)
    digest = hasher.hexdigest()
    _source_keys[id(fn)] = fn, digest
    return digest


_MISSING = object()


def _is_jit(value: Any) -> bool:
    return isinstance(getattr(value, "src", None), str) and hasattr(value, "__globals__")


def _is_constexpr(value: Any) -> bool:
    try:
        from triton.language import constexpr
    except ImportError:
        return False
    return isinstance(value, constexpr)


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python number it equals (``np.int64(64)`` and ``64`` compile to
    the same code, and jax-triton's in-memory cache already takes them as one)."""
    item = getattr(value, "item", None)
    return item() if item is not None and getattr(value, "ndim", None) == 0 else value


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
