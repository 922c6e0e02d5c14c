"""Kernels that jax-triton cannot compile or launch as they are, through its launcher anyway:
:func:`ejkernel_triton._kernel_cache._compile_direct` compiles Gluon kernels and the
warp-specialized forward for sm_90 (Triton's compiler runs on any machine) and caches the PTX
like any other kernel. jax-triton is a stand-in here (the real one needs a GPU jaxlib); the GPU
runs are ``tests/triton/test_flash_attention.py -m gpu``.

Runs in a child process: Triton's interpreter, used by the other tests of this folder, leaves
``triton.language`` patched in its process, and a patched process cannot compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

KERNEL = """
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def scale_kernel(X, factor, n, Y, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    gl.store(Y + offs, gl.load(X + offs, mask=offs < n) * factor, mask=offs < n)
"""

#: A stand-in jax-triton (the real one needs a GPU jaxlib): the kernel object is the tuple of
#: its constructor's arguments; a kernel sent down jax-triton's own route is recorded.
STANDIN = """
lib = types.ModuleType("jax_triton.triton_lib")
lib.get_or_create_triton_kernel = lambda *a, **k: compiled.append("ttir route")
lib.compile_ttir_inplace = lambda *a, **k: None
lib.triton_kernel_call_lib = types.SimpleNamespace(
    TritonKernel=lambda *args: args, get_compute_capability=lambda device: 90
)
pkg = types.ModuleType("jax_triton")
pkg.triton_lib = lib
sys.modules.update({"jax_triton": pkg, "jax_triton.triton_lib": lib})
from ejkernel_triton import _kernel_cache
"""

CHILD = """
import json, os, sys, types
sys.path.insert(0, {folder!r})
os.environ["EJKERNEL_CACHE_DIR"] = {cache!r}
os.environ["TRITON_CACHE_DIR"] = ""  # as jax-triton leaves it
compiled = []
{standin}from gluon_scale import scale_kernel
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
    pytest.importorskip("triton.experimental.gluon")
    (tmp_path / "gluon_scale.py").write_text(textwrap.dedent(KERNEL))
    code = CHILD.format(folder=str(tmp_path), cache=str(tmp_path / "cache"), standin=STANDIN)
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


WS_CHILD = """
import json, os, re, sys, types
os.environ["EJKERNEL_CACHE_DIR"] = {cache!r}
compiled = []
{standin}from ejkernel_triton.kernels.flash_attention_fwd import flash_attention_fwd_ws_kernel as fn
_kernel_cache.install()
kw = dict(num_warps=4, num_stages=2, num_ctas=1, compute_capability=90, enable_fp_fusion=True,
          metaparams=dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, CAUSAL=True, SOFT_CAP=False,
                          EVEN_K=True), dump=False)
# Q, K, V, the (unused) block lists, scale, cap, B, Sq, Sk, Hq, Hkv, the lists' length and
# strides (1 and 0 when the lists are unused), Out, Lse, GlobalScratch
dtypes = ["*bf16"] * 3 + ["*i32"] * 2 + ["fp32"] * 2 + ["i32"] * 10 + ["*bf16", "*fp32", "*i8"]
scalars = [(5, "fp32", 0.1), (6, "fp32", 30.0), (7, "i32", 2), (8, "i32", 4096),
           (9, "i32", 4096), (10, "i32", 16), (11, "i32", 1)]  # num_kv_heads 1: a constant
scalars += [(12, "i32", 1)] + [(i, "i32", 0) for i in range(13, 17)]
kernel, attrs = lib.get_or_create_triton_kernel(None, "cuda", fn, dtypes, scalars, **kw)
_kernel_cache._memory.clear()  # a new process: from the disk cache
again, _ = lib.get_or_create_triton_kernel(None, "cuda", fn, dtypes, scalars, **kw)
name, ptx = kernel[0], kernel[4]
params = re.findall(r"[.]param [^\\n]*" + name + r"_param_(\\d+)", ptx)
print(json.dumps({{"warps": kernel[1], "again_warps": again[1], "shared": kernel[3],
    "params": [int(p) for p in params], "loads": sorted(set(re.findall(r"\\[" + name
    + r"_param_(\\d+)\\]", ptx))), "ttir_route": compiled}}))
"""


def test_the_warp_specialized_forward_launches_its_warps_and_reads_our_scratch(tmp_path):
    """The launch takes the compiler's 12 warps (also when read back from the disk cache), and
    the hidden global-scratch parameter (null from jaxlib) is never read: its loads read the
    kernel's own ``GlobalScratch`` output instead."""
    code = WS_CHILD.format(cache=str(tmp_path / "cache"), standin=STANDIN)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["warps"] == 12 and out["again_warps"] == 12
    assert out["ttir_route"] == []
    # 18 runtime parameters (num_kv_heads and the lists' length folded), then the hidden
    # scratch and profile ones
    assert out["params"] == list(range(20))
    assert "17" in out["loads"]  # GlobalScratch
    assert "18" not in out["loads"] and "19" not in out["loads"]


def test_every_warp_specialized_kernel_and_no_helper_is_compiled_directly():
    """jax-triton's own route launches a warp-specialized kernel with the config's warps, not
    the compiler's (a launch error on the GPU): each kernel whose loop is specialized carries
    :func:`~ejkernel_triton._kernel_cache.compile_directly`, and no ``@triton.jit`` helper
    (inlined into its caller) does."""
    import importlib

    triton = pytest.importorskip("triton")
    marked, unmarked = [], []
    for name in ("flash_attention_fwd", "flash_attention_bwd"):
        module = importlib.import_module(f"ejkernel_triton.kernels.{name}")
        for attr, fn in vars(module).items():
            if not isinstance(fn, triton.runtime.JITFunction) or fn.__module__ != module.__name__:
                continue
            direct = getattr(fn, "ejkernel_compile_directly", False)
            specialized = "warp_specialize=True" in fn.src
            if attr.endswith("_kernel") and specialized:
                (marked if direct else unmarked).append(attr)
            elif direct:
                unmarked.append(f"{attr} (a helper)")
    assert len(marked) == 3 and not unmarked, (marked, unmarked)
