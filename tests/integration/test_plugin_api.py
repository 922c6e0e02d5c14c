"""Plugins use only public core names: the in-tree plugins are written as a third party's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Where plugin code lives: each in-tree backend's package and the example plugin.
PLUGIN_TREES = (
    "ejkernel-xla/src",
    "ejkernel-triton/src",
    "ejkernel-pallas/src",
    "ejkernel-cuda/src",
    "examples",
)

#: ``from ejkernel._x``, ``import ejkernel._x``, ``from ejkernel import _x`` and the same one
#: package further down (``from ejkernel.specs._base import ...``).
PRIVATE_IMPORT = re.compile(
    r"^\s*(?:from\s+ejkernel(?:\.\w+)*\._\w*|import\s+ejkernel(?:\.\w+)*\._\w*"
    r"|from\s+ejkernel(?:\.\w+)*\s+import\s+\(?\s*_\w+)",
    re.MULTILINE,
)


def _private_imports(text: str) -> list[str]:
    return [m.group(0).strip() for m in PRIVATE_IMPORT.finditer(text)]


@pytest.mark.parametrize("tree", PLUGIN_TREES)
def test_plugin_code_imports_no_private_core_module(tree: str) -> None:
    found = [
        f"{path.relative_to(ROOT)}: {line}"
        for path in sorted((ROOT / tree).rglob("*.py"))
        for line in _private_imports(path.read_text(encoding="utf-8"))
    ]
    assert not found, "plugins must use public core names only:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "from ejkernel._params import FwdParams",
        "import ejkernel._env",
        "from ejkernel import _env",
        "    from ejkernel.specs._base import OpSpec",
        "from ejkernel.testing._examples import Example",
    ],
)
def test_the_guard_sees_every_spelling_of_a_private_import(line: str) -> None:
    assert _private_imports(line)


@pytest.mark.parametrize(
    "line",
    [
        "from ejkernel.plugins import BwdParams, FwdParams, defvjp",
        "from ejkernel import env",
        "import ejkernel",
        "from ejkernel.testing import ConformanceSuite",
        "from ejkernel_xla.ops._common import helper",
    ],
)
def test_the_guard_lets_public_imports_through(line: str) -> None:
    assert not _private_imports(line)


def test_the_public_plugin_names_import_without_a_backend() -> None:
    from ejkernel import env
    from ejkernel.plugins import BwdParams, FwdParams, Registry, defvjp, hookimpl

    assert FwdParams(q_blocksize=64).q_blocksize == 64 and BwdParams().num_warps is None
    assert callable(defvjp) and callable(hookimpl) and hasattr(Registry, "register_module")
    assert env.INTERPRET == "EJKERNEL_INTERPRET" and isinstance(env.interpret(), bool)
