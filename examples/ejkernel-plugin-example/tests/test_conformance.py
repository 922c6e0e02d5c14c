"""ejkernel's conformance kit on this plugin's platform: every implementation it registers
(mean_pooling and the new op) against the op's reference, with gradients, jit, vmap and
invalid input. ``pytest --pyargs ejkernel.testing.conformance --ejkernel-platform example``
runs the same tests."""

from __future__ import annotations

from ejkernel.testing import ConformanceSuite


class TestExamplePlatform(ConformanceSuite):
    platforms = ("example",)
