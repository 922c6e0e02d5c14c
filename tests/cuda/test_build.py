"""The nvcc build of the native CUDA kernels: compile check, cache, lock, failures, CLI.

Runs on CPU. The compile check uses the real nvcc when there is one (objects only, no GPU);
the cache tests use a stand-in nvcc (a small script) so they are fast and can fail on demand.
"""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from ejkernel.cli import main
from ejkernel_cuda import _build
from ejkernel_cuda._build import BuildError

FAKE_NVCC = """\
#!{python}
# Stand-in nvcc: records each call, writes the requested output, fails on request.
import os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if args == ["--version"]:
    print("Cuda compilation tools, release 99.9, V99.9.1")
    sys.exit(0)
if os.environ.get("FAKE_NVCC_FAIL") and "-c" in args:
    print("decode_attention.cu(1): error: " + os.environ["FAKE_NVCC_FAIL"])
    sys.exit(2)
time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
out = args[args.index("-o") + 1]
with open(out, "w") as f:
    f.write("object " + " ".join(args))
"""


@pytest.fixture
def fake_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in nvcc first on PATH; its calls are logged to the returned file."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(0o755)
    log = tmp_path / "nvcc.log"
    log.touch()
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    monkeypatch.setenv("PATH", f"{nvcc.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("FAKE_NVCC_FAIL", raising=False)
    monkeypatch.setattr(_build, "_state", {})  # this process's load state, restored after
    return log


def compiles(log: Path) -> int:
    return sum(" -c " in f" {line} " for line in log.read_text().splitlines())


# -- the real compiler -------------------------------------------------------------------------


@pytest.mark.skipif(_build.find_nvcc() is None, reason="no nvcc on this machine")
def test_sources_compile_with_nvcc_for_sm_90(tmp_path: Path) -> None:
    nvcc = _build.find_nvcc()
    assert nvcc is not None
    units = [p for p in _build.source_files() if p.suffix == ".cu"]
    assert {p.name for p in units} == {"decode_attention.cu", "mean_pooling.cu"}
    commands = [
        _build.compile_command(nvcc, src, tmp_path / f"{src.stem}.o", "90") for src in units
    ]
    _build._run_all(commands)
    for src in units:
        assert (tmp_path / f"{src.stem}.o").stat().st_size > 10_000


def test_sources_ship_as_package_data() -> None:
    files = {p.name for p in importlib.resources.files("ejkernel_cuda").joinpath("csrc").iterdir()}
    assert {"common.cuh", "decode_attention.cu", "mean_pooling.cu"} <= files
    text = (_build.CSRC / "decode_attention.cu").read_text()
    for symbol in _build.TARGETS.values():
        assert symbol in text or symbol in (_build.CSRC / "mean_pooling.cu").read_text()


# -- the cache, with a stand-in compiler -------------------------------------------------------


def test_build_compiles_once_then_reuses_the_cached_library(
    fake_nvcc: Path, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    library = _build.build(arch="9.0", root=root)
    assert library.name == _build.LIBRARY and library.is_file()
    assert library.parent.parent == root and (library.parent / "build.json").is_file()
    assert compiles(fake_nvcc) == 2  # one object per .cu file
    assert "-gencode=arch=compute_90,code=sm_90" in fake_nvcc.read_text()
    assert _build.build(arch="90", root=root) == library
    assert compiles(fake_nvcc) == 2
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "temporary folder left"


def test_build_key_changes_with_the_architecture_and_the_sources(
    fake_nvcc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    a = _build.build(arch="90", root=root)
    b = _build.build(arch="80", root=root)
    assert a.parent != b.parent and compiles(fake_nvcc) == 4
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for p in _build.source_files():
        (csrc / p.name).write_text(p.read_text() + "\n// changed\n")
    monkeypatch.setattr(_build, "CSRC", csrc)
    assert _build.build(arch="90", root=root).parent not in (a.parent, b.parent)


def test_concurrent_processes_build_once(fake_nvcc: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    root = tmp_path / "cache"
    code = textwrap.dedent(
        f"""
        from ejkernel_cuda import _build
        print(_build.build(arch="90", root={str(root)!r}))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1 and compiles(fake_nvcc) == 2


def test_a_failed_build_reports_the_compiler_message_and_is_not_retried(
    fake_nvcc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv("FAKE_NVCC_FAIL", "identifier 'boom' is undefined")
    with pytest.raises(BuildError, match="identifier 'boom' is undefined"):
        _build.build(arch="90", root=root)
    assert compiles(fake_nvcc) == 2
    with pytest.raises(BuildError, match="boom"):
        _build.build(arch="90", root=root)
    assert compiles(fake_nvcc) == 2, "a cached failure must not rerun nvcc"
    assert "failed for sm_90" in _build.status(arch="90", root=root)
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    assert _build.build(arch="90", root=root, force=True).is_file()
    assert "built for sm_90" in _build.status(arch="90", root=root)


def test_without_nvcc_the_native_kernels_report_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    monkeypatch.setattr(_build, "normalize_arch", lambda arch: "90")  # as on a GPU
    monkeypatch.setattr(_build, "_state", {})
    with pytest.raises(BuildError, match="nvcc not found"):
        _build.build(arch="90")
    status = _build.native_status()
    assert isinstance(status, str) and "nvcc not found" in status
    assert "nvcc not found" in _build.status(arch="90")


def test_native_status_carries_the_compiler_message(
    fake_nvcc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVCC_FAIL", "expected a ';'")
    monkeypatch.setattr(_build, "normalize_arch", lambda arch: "90")
    status = _build.native_status()
    assert isinstance(status, str)
    assert status.startswith("native CUDA kernels unavailable") and "expected a ';'" in status


@pytest.mark.parametrize(
    ("given", "want"), [("9.0", "90"), ("90", "90"), ("sm_90a", "90a"), ("10.0", "100")]
)
def test_architectures_normalise(given: str, want: str) -> None:
    assert _build.normalize_arch(given) == want


def test_an_unreadable_architecture_is_an_error() -> None:
    with pytest.raises(BuildError, match="compute capability"):
        _build.normalize_arch("hopper")
    if jax.default_backend() != "gpu":
        with pytest.raises(BuildError, match="no NVIDIA GPU"):
            _build.normalize_arch(None)


# -- the CLI -------------------------------------------------------------------------------------


def test_cli_builds_checks_and_reports_failures(
    fake_nvcc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "c"))
    assert main(["build", "cuda", "--check", "--target", "90"]) == 0
    assert "not built yet for sm_90" in capsys.readouterr().out
    assert main(["build", "cuda", "--target", "90"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "c" / "cuda") in out and _build.LIBRARY in out
    assert main(["build", "cuda", "--check", "--target", "90"]) == 0
    assert "built for sm_90" in capsys.readouterr().out
    monkeypatch.setenv("FAKE_NVCC_FAIL", "no such type 'half8'")
    assert main(["build", "cuda", "--target", "90", "--force"]) == 1
    assert "no such type 'half8'" in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU tells the architecture")
def test_cli_without_a_gpu_or_target_says_what_to_pass(capsys) -> None:
    assert main(["build", "cuda"]) == 1
    assert "--target" in capsys.readouterr().err
