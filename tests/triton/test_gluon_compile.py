"""Gluon kernels through jax-triton's launcher: :func:`ejkernel_triton._kernel_cache._compile_gluon`
compiles them for sm_90 (Triton's compiler runs on any machine) and caches the PTX like any
other kernel. jax-triton is a stand-in here (the real one needs a GPU jaxlib); the GPU run is
``benchmarks/experiments/gluon_fwd_ab.py``.

Runs in a child process: Triton's interpreter, used by the other tests of this folder, leaves
``triton.language`` patched in its process, and a patched process cannot compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.experimental.gluon")

KERNEL = """
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def scale_kernel(X, factor, n, Y, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    gl.store(Y + offs, gl.load(X + offs, mask=offs < n) * factor, mask=offs < n)
"""

CHILD = """
import json, os, sys, types
sys.path.insert(0, {folder!r})
os.environ["EJKERNEL_CACHE_DIR"] = {cache!r}
os.environ["TRITON_CACHE_DIR"] = ""  # as jax-triton leaves it
compiled = []
lib = types.ModuleType("jax_triton.triton_lib")
lib.get_or_create_triton_kernel = lambda *a, **k: compiled.append("ttir route")
lib.compile_ttir_inplace = lambda *a, **k: None
lib.triton_kernel_call_lib = types.SimpleNamespace(
    TritonKernel=lambda *args: args, get_compute_capability=lambda device: 90
)
pkg = types.ModuleType("jax_triton")
pkg.triton_lib = lib
sys.modules.update({{"jax_triton": pkg, "jax_triton.triton_lib": lib}})
from ejkernel_triton import _kernel_cache
from gluon_scale import scale_kernel
_kernel_cache.install()
kw = dict(num_warps=4, num_stages=1, num_ctas=1, compute_capability=90,
          enable_fp_fusion=True, metaparams={{"BLOCK": 512}}, dump=False)
args = (None, "cuda", scale_kernel, ["*fp32", "fp32", "i32", "*fp32"],
        [(1, "fp32", 2.0), (2, "i32", 1000)])
first, attrs = lib.get_or_create_triton_kernel(*args, **kw)
_kernel_cache._memory.clear()  # a new process: from the disk cache
again, _ = lib.get_or_create_triton_kernel(*args, **kw)
print(json.dumps({{
    "name": first[0], "warps": first[1], "shared": first[3], "ptx": first[4],
    "again_same": list(again) == list(first), "attrs": sorted(map(list, attrs.items())),
    "ttir_route": compiled, "files": len(list(_kernel_cache.cache_folder().glob("*.json"))),
    "triton_cache_dir": os.environ["TRITON_CACHE_DIR"],
}}))
"""


def test_a_gluon_kernel_compiles_for_hopper_and_is_cached(tmp_path):
    (tmp_path / "gluon_scale.py").write_text(textwrap.dedent(KERNEL))
    code = CHILD.format(folder=str(tmp_path), cache=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["name"] == "scale_kernel" and out["warps"] == 4
    assert ".target sm_90a" in out["ptx"] and "ld.global" in out["ptx"]
    assert out["again_same"] and out["files"] == 1  # read back from disk, not compiled again
    assert out["ttir_route"] == []  # jax-triton's Triton-IR compiler was never asked
    assert out["attrs"] == [
        [[0], [["tt.divisibility", 16]]],
        [[1], []],
        [[2], []],
        [[3], [["tt.divisibility", 16]]],
    ]
    assert out["triton_cache_dir"] == ""  # jax-triton's setting is left as it was
