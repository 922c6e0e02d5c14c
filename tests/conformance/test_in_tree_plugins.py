"""The conformance kit over every installed implementation (xla; triton and pallas through
their interpreters when installed and EJKERNEL_INTERPRET=1): what
``pytest --pyargs ejkernel.testing.conformance`` runs, narrowed by ``--ejkernel-platform``."""

from __future__ import annotations

from ejkernel.testing import ConformanceSuite


class TestInTreePlugins(ConformanceSuite):
    """Every registered implementation of every op."""
