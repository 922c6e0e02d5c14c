"""ejkernel's pytest plugin (entry point ``pytest11: ejkernel``): the conformance kit's options.

It only adds command-line options, so it costs nothing in test runs that do not use the kit;
the tests themselves are :class:`ejkernel.testing.ConformanceSuite` (run them with
``pytest --pyargs ejkernel.testing.conformance``) and are generated when collected.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ejkernel", "ejkernel conformance kit")
    group.addoption(
        "--ejkernel-platform",
        action="append",
        default=[],
        metavar="NAME",
        help="check only the implementations of these platforms (comma-separated or repeated); "
        "default: every platform with a registered implementation",
    )
    group.addoption(
        "--ejkernel-op",
        action="append",
        default=[],
        metavar="OP",
        help="check only these ops (comma-separated or repeated); default: every op",
    )
    group.addoption(
        "--ejkernel-thorough",
        action="store_true",
        default=False,
        help="also run the thorough examples, bfloat16 gradients, jit/vmap of every example "
        "and every config of each implementation's config_space",
    )


def pytest_configure(config: pytest.Config) -> None:
    """A platform nobody registered is a usage error (checked only when the option is given)."""
    wanted = config.getoption("ejkernel_platform")
    if not wanted:
        return
    from ejkernel.testing._suite import check_platforms

    try:
        check_platforms(wanted)
    except ValueError as err:
        raise pytest.UsageError(f"--ejkernel-platform: {err}") from None
