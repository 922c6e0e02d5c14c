"""The on-disk cache of jax-triton's compiled kernels, against a stand-in jax-triton (the real
one imports only with a GPU jaxlib; the GPU harness measures the real warm start)."""

from __future__ import annotations

import json
import sys
import types
import warnings

import numpy as np
import pytest

from ejkernel_triton import _kernel_cache


class _Kernel:
    def __init__(self, *args):
        self.args = args


@pytest.fixture
def fake_jax_triton(monkeypatch, tmp_path):
    """A jax_triton.triton_lib whose compiler counts its calls; the cache in a temp folder."""
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path))
    calls = []
    own_cache = {}  # like jax-triton's: keys compare by value, so True == 1 == np.int64(1)
    lib = types.ModuleType("jax_triton.triton_lib")

    def compile_ttir_inplace(module, *args):
        return types.SimpleNamespace(name="kern", binary=f"PTX of {module}", shared_mem_bytes=96)

    def get_or_create_triton_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
        own_key = (fn.cache_key, kw["num_warps"], tuple(sorted(kw["metaparams"].items())))
        if own_key in own_cache:
            return own_cache[own_key]
        calls.append(fn.cache_key)
        result = lib.compile_ttir_inplace(f"ttir<{fn.cache_key}>")  # looked up at call time
        kernel = _Kernel(result.name, kw["num_warps"], result.binary)
        own_cache[own_key] = kernel, {(0,): [["tt.divisibility", 16]], (1,): []}
        return own_cache[own_key]

    lib.compile_ttir_inplace = compile_ttir_inplace
    lib.get_or_create_triton_kernel = get_or_create_triton_kernel
    lib.own_cache = own_cache
    lib.triton_kernel_call_lib = types.SimpleNamespace(
        TritonKernel=_Kernel, get_compute_capability=lambda device: 90
    )
    pkg = types.ModuleType("jax_triton")
    pkg.triton_lib = lib
    monkeypatch.setitem(sys.modules, "jax_triton", pkg)
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", lib)
    monkeypatch.setattr(_kernel_cache, "_installed", False)
    monkeypatch.setattr(_kernel_cache, "_memory", {})
    monkeypatch.setattr(_kernel_cache, "_entries", {})
    monkeypatch.setattr(_kernel_cache, "_warned_unwritable", False)
    _kernel_cache.install()
    return lib, calls


def _get(lib, source="src-a", warps=4, block=64):
    fn = types.SimpleNamespace(cache_key=source)
    return lib.get_or_create_triton_kernel(
        None,
        "cuda",
        fn,
        ["*bf16", "i32"],
        [(1, "i32", 7)],
        num_warps=warps,
        num_stages=2,
        num_ctas=1,
        compute_capability=None,
        enable_fp_fusion=True,
        metaparams={"BLOCK": block},
        dump=False,
    )


def _new_process(lib):
    _kernel_cache._memory.clear()
    _kernel_cache._entries.clear()
    lib.own_cache.clear()


def test_second_process_reads_the_kernel_from_disk(fake_jax_triton):
    lib, calls = fake_jax_triton
    _, attrs = _get(lib)
    assert calls == ["src-a"]
    files = list(_kernel_cache.cache_folder().glob("*.json"))
    assert len(files) == 1
    entry = json.loads(files[0].read_text())
    assert entry["ptx"] == "PTX of ttir<src-a>" and entry["ttir"] == "ttir<src-a>"

    _get(lib)  # same process: memory
    _new_process(lib)
    again, attrs_again = _get(lib)
    assert calls == ["src-a"]  # not compiled again
    assert again.args == ("kern", 4, 1, 96, "PTX of ttir<src-a>", "ttir<src-a>", 90)
    assert attrs_again == attrs


def test_numpy_scalars_take_the_key_of_the_python_numbers(fake_jax_triton):
    lib, calls = fake_jax_triton
    _get(lib, block=np.int64(64))
    _new_process(lib)
    _get(lib, block=64)
    assert calls == ["src-a"]
    assert len(list(_kernel_cache.cache_folder().glob("*.json"))) == 1


def test_a_hit_in_jax_tritons_own_cache_is_written_too(fake_jax_triton):
    """jax-triton takes True and 1 as one key and answers the second from memory, without
    compiling: that kernel must still reach the disk, or the next process compiles it."""
    lib, calls = fake_jax_triton
    first, _ = _get(lib, block=1)
    second, _ = _get(lib, block=True)
    assert second is first and calls == ["src-a"]
    assert len(list(_kernel_cache.cache_folder().glob("*.json"))) == 2
    _new_process(lib)
    again, _ = _get(lib, block=True)
    assert calls == ["src-a"]  # read from disk, not compiled
    assert again.args[4] == "PTX of ttir<src-a>"


def test_anything_that_changes_the_code_changes_the_key(fake_jax_triton):
    lib, calls = fake_jax_triton
    _get(lib)
    _get(lib, source="src-b")  # edited kernel source
    _get(lib, warps=8)
    assert calls == ["src-a", "src-b", "src-a"]
    assert len(list(_kernel_cache.cache_folder().glob("*.json"))) == 3


@pytest.mark.parametrize("content", ["{not json", json.dumps({"name": 3}), ""])
def test_corrupt_file_warns_and_compiles_again(fake_jax_triton, content):
    lib, calls = fake_jax_triton
    _get(lib)
    (path,) = _kernel_cache.cache_folder().glob("*.json")
    path.write_text(content)
    _new_process(lib)
    with pytest.warns(UserWarning, match="corrupt kernel cache"):
        _get(lib)
    assert len(calls) == 2
    assert json.loads(path.read_text())["ptx"]  # rewritten whole


def test_unwritable_folder_warns_once_and_works(fake_jax_triton, tmp_path):
    lib, _ = fake_jax_triton
    blocker = tmp_path / "triton"
    blocker.write_text("a file where the folder should be")
    with pytest.warns(UserWarning, match="cannot write the kernel cache"):
        kernel, _ = _get(lib)
    assert kernel.args[0] == "kern"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _get(lib, source="src-b")  # warned once already
    assert blocker.read_text().startswith("a file")  # nothing else lost


def test_other_platforms_are_not_cached(fake_jax_triton):
    lib, calls = fake_jax_triton
    fn = types.SimpleNamespace(cache_key="src-a")
    kw = dict(
        num_warps=4,
        num_stages=2,
        num_ctas=1,
        compute_capability=90,
        enable_fp_fusion=True,
        metaparams={},
        dump=False,
    )
    lib.get_or_create_triton_kernel(None, "rocm", fn, ["*bf16"], [], **kw)
    assert calls == ["src-a"]
    assert not _kernel_cache.cache_folder().exists()


_PROBE = """
import triton
import triton.language as tl

SCALE: tl.constexpr = tl.constexpr({scale})


@triton.jit
def _helper(x):
    return x * {factor}


@triton.jit
def kernel(x_ptr):
    tl.store(x_ptr, _helper(tl.load(x_ptr)) * SCALE)
"""


def _probe_kernel(tmp_path, name, scale=2.0, factor=3):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(_PROBE.format(scale=scale, factor=factor))
    spec = importlib.util.spec_from_file_location("ejkernel_probe_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


def test_source_key_follows_helpers_and_constexprs(tmp_path):
    base = _kernel_cache.source_key(_probe_kernel(tmp_path, "a"))
    assert _kernel_cache.source_key(_probe_kernel(tmp_path, "b")) == base  # same text
    assert _kernel_cache.source_key(_probe_kernel(tmp_path, "c", scale=4.0)) != base
    assert _kernel_cache.source_key(_probe_kernel(tmp_path, "d", factor=5)) != base


def test_source_key_does_not_depend_on_what_the_process_keyed_first():
    """Triton's ``JITFunction.cache_key`` of a kernel changed when another kernel sharing its
    helpers had been keyed first in the process: a warm start compiled the kernel again."""
    import subprocess

    code = """
import sys
from ejkernel_triton import _kernel_cache
from ejkernel_triton.kernels import flash_attention_bwd as bwd, flash_attention_fwd as fa
from ejkernel_triton.kernels import flash_attention_hopper_bwd as hbwd
from ejkernel_triton.kernels import flash_attention_hopper_fwd as hfwd
if sys.argv[1] == "others-first":
    for module in (hbwd, hfwd, bwd, fa):
        for name in dir(module):
            if name.endswith("_kernel") and name != "flash_attention_fwd_kernel":
                getattr(module, name).cache_key
                _kernel_cache.source_key(getattr(module, name))
print(_kernel_cache.source_key(fa.flash_attention_fwd_kernel))
"""
    keys = {
        order: subprocess.run(
            [sys.executable, "-c", code, order], capture_output=True, text=True, check=True
        ).stdout.strip()
        for order in ("alone", "others-first")
    }
    assert len(keys["alone"]) == 64 and keys["alone"] == keys["others-first"]
