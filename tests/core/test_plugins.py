"""Plugin discovery through entry points: isolation of broken plugins, disabling, API versions."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.errors import PluginWarning
from ejkernel.plugins import get_registry, plugin_infos

GOOD = """
from ejkernel.plugins import hookimpl

@hookimpl
def ejkernel_api_version():
    return 1

@hookimpl
def ejkernel_register(registry):
    registry.add_platform("{name}", available="{name}_plugin:available")
    registry.register("flash_attention", platform="{name}", backend="any", priority={priority})(
        "{name}_plugin:impl")

def available(backend):
    return True

def impl(*, cfg, query, key, value, **kw):
    import ejkernel.specs.flash_attention as fa
    return fa.flash_attention_reference(query, key, value, **kw) * 0 + {priority}
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path where tests install fake distributions with entry points."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)

    def install(dist: str, module: str, source: str, entry_name: str | None = None) -> None:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"{dist}-1.0.dist-info"
        info.mkdir()
        info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        info.joinpath("entry_points.txt").write_text(
            f"[ejkernel.plugins]\n{entry_name or dist} = {module}\n"
        )

    yield install
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def _q():
    x = jnp.ones((1, 5, 2, 8)) * jnp.arange(8.0)
    return x, x, x


def test_a_plugin_installed_through_entry_points_is_discovered_and_selected(site):
    site("fast", "fast_plugin", GOOD.format(name="fast", priority=7))
    assert ejkernel.explain("flash_attention", *_q()).platform == "fast"
    assert float(ejkernel.flash_attention(*_q())[0, 0, 0, 0]) == 7.0
    info = {i.name: i for i in plugin_infos()}
    assert info["fast"].status == "loaded" and info["fast"].distribution == "fast 1.0"


def test_broken_plugin_warns_and_others_still_load(site):
    site("aaa-broken", "broken_plugin", "raise ImportError('no such thing')\n", entry_name="broken")
    site(
        "bbb-raises",
        "raises_plugin",
        GOOD.format(name="raises", priority=9).replace(
            'registry.register("flash_attention"',
            'registry.register("flash_attention", platform="x", backend="any")(len)\n    raise RuntimeError("boom")\n    registry.register("flash_attention"',
        ),
        entry_name="raises",
    )
    site("ccc-good", "good_plugin", GOOD.format(name="good", priority=5), entry_name="good")
    with pytest.warns(PluginWarning) as record:
        registry = get_registry()
    messages = " | ".join(str(w.message) for w in record)
    assert "'broken'" in messages and "no such thing" in messages
    assert "'raises'" in messages and "boom" in messages
    platforms = {i.platform for i in registry.implementations("flash_attention")}
    assert "good" in platforms and "x" not in platforms  # the failed plugin was rolled back
    status = {i.name: i.status for i in plugin_infos()}
    assert (
        status["broken"] == "failed" and status["raises"] == "failed" and status["good"] == "loaded"
    )


def test_another_thread_waits_for_discovery_to_end(site):
    # A thread asking for the registry while discovery runs gets it whole, not half filled.
    slow = GOOD.format(name="late", priority=7).replace(
        "def ejkernel_register(registry):",
        "def ejkernel_register(registry):\n    started.set()\n    time.sleep(0.3)",
    )
    site("late", "late_plugin", "import threading, time\nstarted = threading.Event()\n" + slow)
    discovering = threading.Thread(target=get_registry)
    discovering.start()
    for _ in range(500):
        if "late_plugin" in sys.modules and sys.modules["late_plugin"].started.is_set():
            break
        time.sleep(0.01)
    assert sys.modules["late_plugin"].started.is_set()
    assert "late" in get_registry().platforms()
    discovering.join()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("return 1", "return 2"), "built for core plugin API 2"),
        (("def ejkernel_api_version", "def _nothing"), "no `ejkernel_api_version` hook"),
    ],
    ids=["another-api-version", "no-api-version"],
)
def test_plugin_for_another_or_no_api_version_is_refused(site, edit, message):
    site("off", "off_plugin", GOOD.format(name="off", priority=3).replace(*edit))
    with pytest.warns(PluginWarning, match=message):
        registry = get_registry()
    assert "off" not in {i.platform for i in registry.implementations("flash_attention")}
    assert {i.name: i.status for i in plugin_infos()}["off"] == "refused"


def test_disable_plugins_skips_named_entry_points(site, monkeypatch):
    site("fast", "fast_plugin", GOOD.format(name="fast", priority=7))
    monkeypatch.setenv("EJKERNEL_DISABLE_PLUGINS", "fast, other")
    assert "fast" not in get_registry().platforms()
    assert {i.name: i.status for i in plugin_infos()}["fast"] == "disabled"


def test_autoload_off_skips_discovery_and_register_plugin_adds_by_hand(site, monkeypatch):
    site("fast", "fast_plugin", GOOD.format(name="fast", priority=7))
    monkeypatch.setenv("EJKERNEL_PLUGINS_AUTOLOAD", "0")
    assert get_registry().platforms() == []
    import fast_plugin

    ejkernel.plugins.register_plugin(fast_plugin)
    assert get_registry().platforms() == ["fast"]


def test_unavailable_platform_is_rejected_with_the_probes_reason(site):
    site(
        "slow",
        "slow_plugin",
        GOOD.format(name="slow", priority=99).replace("return True", "return 'needs a GPU'"),
    )
    sel = ejkernel.explain("flash_attention", *_q())
    assert sel.platform != "slow" and sel.rejected["slow"] == "needs a GPU"


def test_a_plugin_may_add_a_new_op(site):
    site(
        "newop",
        "newop_plugin",
        """
        import jax.numpy as jnp
        from ejkernel.plugins import hookimpl
        from ejkernel.specs import Arg, OpSpec

        def _validate(a):
            if a["x"].ndim != 1:
                raise ValueError("double: `x` must be [N]")
            return a

        SPEC = OpSpec(name="double", args=(Arg(name="x", array=True, required=True, differentiable=True),),
                      validate=_validate, reference=lambda x: 2 * x)

        @hookimpl
        def ejkernel_api_version():
            return 1

        @hookimpl
        def ejkernel_register(registry):
            registry.add_op(SPEC)
            registry.register("double", platform="xla", backend="any")(lambda *, x, cfg: x + x)
    """,
    )
    from ejkernel._executor import call_op
    from ejkernel.modules import create_default_executor  # noqa: F401  (ops framework loads)

    spec = get_registry().spec("double")
    assert call_op(spec, {"x": jnp.arange(3.0)}).tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="`x` must be"):
        call_op(spec, {"x": jnp.ones((2, 2))})


def test_import_ejkernel_loads_no_backend_library():
    code = (
        "import sys, jax, ejkernel, ejkernel.ops, ejkernel.modules, ejkernel_xla.plugin\n"
        "from ejkernel.plugins import get_registry\n"
        "get_registry()\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('triton', 'jax_triton')"
        " or m.startswith(('ejkernel_xla.ops', 'ejkernel_triton.ops', 'ejkernel_pallas.ops', 'ejkernel_cuda.ops'))]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
