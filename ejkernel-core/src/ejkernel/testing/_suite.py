"""The conformance kit as pytest tests: :class:`ConformanceSuite`, a base class to subclass.

Subclass it under a ``Test`` name in a test module and every installed implementation of
every op (or the platforms and ops the subclass names, or ``--ejkernel-platform`` /
``--ejkernel-op`` on the command line) is checked against the op's reference::

    from ejkernel.testing import ConformanceSuite

    class TestMyPlatform(ConformanceSuite):
        platforms = ("mine",)

``pytest --pyargs ejkernel.testing.conformance --ejkernel-platform NAME`` runs the same suite
without writing a test module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from ejkernel.specs import OpSpec
from ejkernel.testing import _checks
from ejkernel.testing._examples import Example, Invalid, examples_of, invalid_cases_of

__all__ = ["Case", "ConformanceSuite", "conformance_cases"]

_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

#: Test argument -> the kind of case it receives.
KINDS = {
    "forward_case": "forward",
    "gradient_case": "gradient",
    "jit_case": "jit",
    "vmap_case": "vmap",
    "invalid_case": "invalid",
    "config_case": "config",
}


@attrs.frozen(kw_only=True, eq=False)
class Case:
    """One conformance test: an implementation (op, platform) and what to check it on.

    ``example`` is ``None`` when the op declares no examples (the test skips and says so).
    """

    op: str
    platform: str
    example: Example | None = None
    dtype: str = "float32"
    invalid: Invalid | None = None

    def __str__(self) -> str:
        parts = [self.op, self.platform]
        if self.example is None:
            parts.append("no-examples")
        elif self.invalid is not None:
            parts.append(str(self.invalid))
        else:
            parts += [str(self.example), _SHORT.get(self.dtype, self.dtype)]
        return "-".join(parts)

    def need_example(self) -> Example:
        if self.example is None:
            pytest.skip(
                f"{self.op} declares no conformance examples (OpSpec.examples is None); "
                "the kit cannot check it"
            )
        assert self.example is not None  # pytest.skip raised (typed as returning to mypy)
        return self.example


def conformance_cases(
    kind: str,
    *,
    platforms: tuple[str, ...] | None = None,
    ops: tuple[str, ...] | None = None,
    thorough: bool = False,
) -> list[Case]:
    """The cases of ``kind`` (forward, gradient, jit, vmap, invalid, config) for every
    registered implementation of ``platforms`` (default: every platform) and ``ops``.

    Raises:
        ValueError: a named platform has no implementation registered.
        KeyError: a named op is unknown.
    """
    from ejkernel.plugins import get_registry

    registry = get_registry()
    check_platforms(platforms or ())
    for op in ops or ():
        registry.spec(op)  # KeyError naming the known ops
    cases: list[Case] = []
    for op in ops or registry.ops():
        spec = registry.spec(op)
        mine = sorted({i.platform for i in registry.implementations(op)})
        chosen = [p for p in mine if platforms is None or p in platforms]
        if not chosen:
            continue
        examples = examples_of(spec, thorough=thorough)
        for platform in chosen:
            if not examples:
                cases.append(Case(op=op, platform=platform))
                continue
            cases += _cases_of(kind, spec, platform, examples, thorough)
    return cases


def check_platforms(platforms: Any) -> None:
    """Raise ValueError unless every platform named (``"a,b"`` strings allowed) has a
    registered implementation."""
    from ejkernel.plugins import get_registry

    known = get_registry().platforms()
    for p in _names(platforms) or ():
        if p not in known:
            raise ValueError(
                f"no implementation of any op is registered for platform {p!r}; registered "
                f"platforms: {', '.join(known) or 'none'} (is its plugin installed?)"
            )


def _cases_of(
    kind: str, spec: OpSpec, platform: str, examples: list[Example], thorough: bool
) -> list[Case]:
    op, first = spec.name, examples[0]
    if kind == "forward":
        # Every dtype of the first example; the others in their first dtype unless thorough.
        return [
            Case(op=op, platform=platform, example=e, dtype=d)
            for e in examples
            for d in (e.dtypes if thorough or e is first else e.dtypes[:1])
        ]
    if kind == "gradient":
        if not spec.differentiable:
            return []
        dtypes: Callable[[Example], tuple[str, ...]] = (
            (lambda e: e.dtypes) if thorough else (lambda e: ("float32",))
        )
        return [
            Case(op=op, platform=platform, example=e, dtype=d)
            for e in examples
            if e.grad is True or (thorough and e.grad == "thorough")
            for d in dtypes(e)
        ]
    if kind in ("jit", "vmap"):
        chosen = examples if thorough else [first]
        return [Case(op=op, platform=platform, example=e) for e in chosen]
    if kind == "invalid":
        return [
            Case(op=op, platform=platform, example=first, invalid=i) for i in invalid_cases_of(spec)
        ]
    if kind == "config":
        return [Case(op=op, platform=platform, example=first)] if thorough else []
    raise ValueError(f"unknown conformance case kind {kind!r}")


def _option(config: pytest.Config, name: str) -> Any:
    try:
        return config.getoption(name)
    except ValueError:  # the pytest plugin is not loaded (PYTEST_DISABLE_PLUGIN_AUTOLOAD)
        return None


def _verdict(check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    try:
        check(*args, **kwargs)
    except _checks.Declined as why:
        pytest.skip(str(why))


class ConformanceSuite:
    """Base class of the conformance tests; subclass it as ``Test<Something>``.

    Attributes:
        platforms: the platforms to check; ``None`` takes ``--ejkernel-platform``, else
            every platform with a registered implementation.
        ops: the ops to check; ``None`` takes ``--ejkernel-op``, else every op.
        thorough: add the thorough examples, bfloat16 gradients, jit and vmap of every
            example, and every config of ``config_space``; ``None`` takes
            ``--ejkernel-thorough``.
    """

    platforms: tuple[str, ...] | None = None
    ops: tuple[str, ...] | None = None
    thorough: bool | None = None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrize each test of the suite with its cases (at collection)."""
        kinds = [name for name in metafunc.fixturenames if name in KINDS]
        if not kinds:
            return
        config = metafunc.config
        platforms = _names(_option(config, "ejkernel_platform")) or self.platforms
        ops = _names(_option(config, "ejkernel_op")) or self.ops
        thorough = bool(_option(config, "ejkernel_thorough")) or bool(self.thorough)
        for name in kinds:
            try:
                cases = conformance_cases(
                    KINDS[name], platforms=platforms, ops=ops, thorough=thorough
                )
            except (KeyError, ValueError) as err:
                raise pytest.UsageError(f"ejkernel conformance: {err}") from None
            if not cases:
                why = (
                    "every config is checked with --ejkernel-thorough"
                    if KINDS[name] == "config" and not thorough
                    else f"no {KINDS[name]} cases for the selected platforms and ops"
                )
                metafunc.parametrize(
                    name, [pytest.param(None, marks=pytest.mark.skip(reason=why))], ids=["none"]
                )
                continue
            metafunc.parametrize(name, cases, ids=str)

    @pytest.fixture(autouse=True)
    def _ejkernel_isolated(self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """A temporary cache folder, the heuristics policy, no forced platform, a fresh
        executor; everything restored afterwards."""
        from ejkernel import _env, _executor

        monkeypatch.setenv(_env.CACHE_DIR, str(tmp_path / "ejkernel-cache"))
        monkeypatch.setenv(_env.AUTOTUNE_POLICY, "heuristics")
        monkeypatch.delenv(_env.PLATFORM, raising=False)
        saved = _executor._default
        _executor._default = None
        try:
            yield
        finally:
            _executor._default = saved

    def test_forward_matches_the_reference(self, forward_case: Case) -> None:
        """Outputs of every example, in every dtype, match the reference (supports() decides
        which examples apply: an implementation that claims support must be right)."""
        c = forward_case
        _verdict(_checks.check_forward, c.op, c.platform, c.need_example(), c.dtype)

    def test_gradients_match_autodiff_of_the_reference(self, gradient_case: Case) -> None:
        """Gradients of every differentiable argument match autodiff of the reference."""
        c = gradient_case
        _verdict(_checks.check_gradients, c.op, c.platform, c.need_example(), c.dtype)

    def test_runs_under_jit(self, jit_case: Case) -> None:
        """The op runs under jax.jit with every array traced."""
        c = jit_case
        _verdict(_checks.check_jit, c.op, c.platform, c.need_example())

    def test_runs_under_vmap(self, vmap_case: Case) -> None:
        """The op runs under jax.vmap over its floating inputs."""
        c = vmap_case
        _verdict(_checks.check_vmap, c.op, c.platform, c.need_example())

    def test_invalid_input_is_rejected_before_the_implementation_runs(
        self, invalid_case: Case
    ) -> None:
        """Bad input raises ValueError/TypeError naming the op; the implementation never runs."""
        c = invalid_case
        if c.invalid is None:
            c.need_example()
            return
        _verdict(_checks.check_rejects_invalid, c.op, c.platform, c.need_example(), c.invalid)

    def test_every_config_matches_the_reference(self, config_case: Case) -> None:
        """Every config the implementation offers for tuning gives the reference's output
        (thorough runs only)."""
        c = config_case
        _verdict(_checks.check_configs, c.op, c.platform, c.need_example())


def _names(value: Any) -> tuple[str, ...] | None:
    """``"a,b"`` or a list of such (repeated options) -> ``("a", "b")``; empty -> None."""
    if not value:
        return None
    items = value if isinstance(value, list | tuple) else [value]
    names = tuple(n.strip().lower() for item in items for n in str(item).split(",") if n.strip())
    return names or None
