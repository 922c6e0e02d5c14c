"""The conformance kit over every installed implementation (xla; triton and pallas through
their interpreters, which this folder's conftest turns on): what
``EJKERNEL_INTERPRET=1 pytest --pyargs ejkernel.testing.conformance`` runs, narrowed by
``--ejkernel-platform``."""

from __future__ import annotations

from ejkernel.testing import ConformanceSuite


class TestInTreePlugins(ConformanceSuite):
    """Every registered implementation of every op."""
