"""Task runner: `nox -s ci` is what CI runs (`.ci/run`); `nox -s demo` is the quick start.

`ci` installs once and runs in that one environment what the sessions `lint`, `tests` (the
tests and the conformance kit, in one pytest run), `docs` and `example-plugin` run each in their
own; the commands are shared (`_lint`, `_tests`, ...), so the two ways run the same checks.
"""

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
TEST_DEPS = [
    "pytest>=8",
    "pytest-xdist>=3",
    "pytest-rerunfailures>=16",
    "pytest-timeout>=2.3",
    "triton==3.6.0",
]
#: A test whose worker process dies (a segfault) or stops (past ``--timeout``) runs again, once
#: or twice, on a fresh worker; a test that fails is never run again. jaxlib 0.10's CPU client,
#: in a worker that has compiled and run programs for over a thousand tests, now and then
#: segfaults in ``backend_compile_and_load`` or waits forever for an execution slot
#: (jax-ml/jax#25861) where the same test passes on its own and in the same order in one
#: process; without this, one such event turns a green run red or holds it until CI's limit.
WORKER_RECOVERY = (
    "--reruns",
    "2",
    "--only-rerun",
    "crashed while running",
    "--timeout",
    "300",
    "--timeout-method",
    "thread",
)
DOCS_DEPS = ["-r", "docs/requirements.txt"]
RUFF = "ruff==0.17.6"  # pinned: new releases add rules
EXAMPLE_PLUGIN = "./examples/ejkernel-plugin-example"


def _lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _tests(session: nox.Session, *args: str, marks: str = "not gpu") -> None:
    """The CPU tests and the conformance kit over every in-tree plugin, in one run on two
    workers (the kit's own conftest turns the Triton and Pallas interpreters on for its tests).
    ``marks``: the marker expression (CI adds ``not slow``: tests/slow.txt)."""
    session.run(
        "pytest",
        "-m",
        marks,
        "-n",
        "2",
        "--dist",
        "worksteal",
        "--durations=20",
        *WORKER_RECOVERY,
        *args,
    )


def _conformance(session: nox.Session, *args: str) -> None:
    session.run("pytest", "tests/conformance", "-m", "not gpu", "-n", "2", *args)


def _docs(session: nox.Session) -> None:
    session.run("mkdocs", "build", "--strict")


def _example_plugin(session: nox.Session, *args: str) -> None:
    session.run("pytest", "examples/ejkernel-plugin-example/tests", *args)


@nox.session
def ci(session: nox.Session) -> None:
    """What CI runs, in one install: lint, the tests and the conformance kit over every in-tree
    plugin (without the `slow` ones: tests/slow.txt; `nox -s tests` runs them), the docs build, then the example plugin (installed last: the docs' support matrix
    and the tests see the in-tree plugins only)."""
    session.install(*PACKAGES, *TEST_DEPS, *DOCS_DEPS, RUFF)
    _lint(session)
    _tests(session, marks="not gpu and not slow")
    _docs(session)
    session.install("--no-deps", EXAMPLE_PLUGIN)
    _example_plugin(session)


@nox.session
def tests(session: nox.Session) -> None:
    """Install every distribution and run every CPU test (GPU tests are deselected), the
    `slow` ones and the conformance kit (Triton and Pallas through their interpreters) included. Arguments go to pytest in
    place of that selection: `nox -s tests -- tests/xla -x`."""
    session.install(*PACKAGES, *TEST_DEPS)
    if session.posargs:
        session.run("pytest", "-m", "not gpu", *session.posargs)
        return
    _tests(session)


#: Session ``tests-<name>``: the CPU tests of some folders, with what they cover.
TEST_AREAS = {
    "core": (["tests/core", "tests/integration"], "Core tests only."),
    "xla": (["tests/xla"], "XLA backend tests only."),
    "triton": (["tests/triton"], "Triton kernels through Triton's interpreter on the CPU."),
    "pallas": (
        ["tests/pallas"],
        "Pallas kernels in interpret mode (TPU kernels; Mosaic GPU ones with absl-py).",
    ),
    "cuda": (
        ["tests/cuda"],
        "CUDA plugin on the CPU: nvcc compile check, build cache, cuDNN/native supports().",
    ),
}


def _area_session(name: str, folders: list[str], doc: str) -> None:
    def area(session: nox.Session) -> None:
        session.install(*PACKAGES, *TEST_DEPS)
        session.run("pytest", *folders, "-m", "not gpu", *session.posargs)

    area.__doc__ = doc
    nox.session(name=f"tests-{name}")(area)


for _name, (_folders, _doc) in TEST_AREAS.items():
    _area_session(_name, _folders, _doc)


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance kit over every in-tree plugin (Triton and Pallas through interpreters)."""
    session.install(*PACKAGES, *TEST_DEPS)
    _conformance(session, *session.posargs)


@nox.session(name="example-plugin")
def example_plugin(session: nox.Session) -> None:
    """Install the example third-party plugin and run its tests (the conformance kit on it)."""
    session.install(*PACKAGES, EXAMPLE_PLUGIN, "pytest>=8")
    _example_plugin(session, *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with MkDocs, warnings as errors (into build/site)."""
    session.install(*PACKAGES, *DOCS_DEPS)
    _docs(session)


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
    session.install(RUFF)
    _lint(session)


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
