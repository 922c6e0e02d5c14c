"""The conformance kit over every installed implementation, as a test module.

Run ``pytest --pyargs ejkernel.testing.conformance`` (every platform) or add
``--ejkernel-platform NAME`` (one platform), ``--ejkernel-op OP``, ``--ejkernel-thorough``.
"""

from __future__ import annotations

from ejkernel.testing._suite import ConformanceSuite


class TestConformance(ConformanceSuite):
    """Every registered implementation of every op (narrowed by the command-line options)."""
