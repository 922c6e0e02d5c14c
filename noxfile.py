"""Task runner: `nox -s tests` is what CI runs; `nox -s demo` is the quick start."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

DISTRIBUTIONS = [
    "ejkernel-core",
    "ejkernel-xla",
    "ejkernel-triton",
    "ejkernel-pallas",
    "ejkernel-cuda",
]
PACKAGES = [arg for dist in DISTRIBUTIONS for arg in ("-e", dist)]
#: triton pinned to the GPU machine's version: the interpreter path is tested against it.
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3", "triton==3.6.0"]


@nox.session
def tests(session: nox.Session) -> None:
    """Install core + xla and run every CPU test (GPU tests are deselected)."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("pytest", "-m", "not gpu", "-n", "2", *session.posargs)


@nox.session(name="tests-core")
def tests_core(session: nox.Session) -> None:
    """Core tests only."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("pytest", "tests/core", "tests/integration", "-m", "not gpu", *session.posargs)


@nox.session(name="tests-xla")
def tests_xla(session: nox.Session) -> None:
    """XLA backend tests only."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("pytest", "tests/xla", "-m", "not gpu", *session.posargs)


@nox.session(name="tests-triton")
def tests_triton(session: nox.Session) -> None:
    """Triton kernels through Triton's interpreter on the CPU."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("pytest", "tests/triton", "-m", "not gpu", *session.posargs)


@nox.session(name="tests-pallas")
def tests_pallas(session: nox.Session) -> None:
    """Pallas kernels in interpret mode (TPU kernels; Mosaic GPU ones with absl-py)."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("pytest", "tests/pallas", "-m", "not gpu", *session.posargs)


@nox.session(name="tests-cuda")
def tests_cuda(session: nox.Session) -> None:
    """CUDA plugin on the CPU: nvcc compile check, build cache, cuDNN/native supports()."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("pytest", "tests/cuda", "-m", "not gpu", *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance kit over every in-tree plugin (Triton and Pallas through interpreters)."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run(
        "pytest",
        "tests/conformance",
        "-m",
        "not gpu",
        "-n",
        "2",
        *session.posargs,
        env={"EJKERNEL_INTERPRET": "1"},
    )


@nox.session(name="example-plugin")
def example_plugin(session: nox.Session) -> None:
    """Install the example third-party plugin and run its tests (the conformance kit on it)."""
    session.install(*PACKAGES, "./examples/ejkernel-plugin-example", "pytest>=8")
    session.run("pytest", "examples/ejkernel-plugin-example/tests", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with MkDocs, warnings as errors (into build/site)."""
    session.install(*PACKAGES, "-r", "docs/requirements.txt")
    session.run("mkdocs", "build", "--strict")


@nox.session
def oldest(session: nox.Session) -> None:
    """Tests against the oldest supported jax (0.10)."""
    session.install(*PACKAGES, *TEST_DEPS, "jax==0.10.*", "jaxlib==0.10.*")
    session.run("pytest", "-m", "not gpu", "-n", "2", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The quick start: install core + xla, run flash attention, print what was chosen and why."""
    session.install("-e", "ejkernel-core", "-e", "ejkernel-xla")
    session.run("python", "examples/quickstart.py", env={"EJKERNEL_AUTOTUNE_POLICY": "autotune"})
    session.run("ejkernel", "info")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff==0.17.6")  # pinned: new releases add rules
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the core."""
    session.install(*PACKAGES, "mypy>=1.10")
    session.run("mypy")


@nox.session
def build(session: nox.Session) -> None:
    """Build the sdists and wheels of every distribution into dist/."""
    session.install("build")
    for dist in DISTRIBUTIONS:
        session.run("python", "-m", "build", "--outdir", "dist", dist)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """CPU benchmarks of benchmarks/ (GPU runs go through the lent machine; see BENCHMARKS)."""
    session.install(*PACKAGES)
    session.run("python", "benchmarks/bench_core.py")
    session.run("python", "benchmarks/bench_flash_attention.py", *session.posargs)
