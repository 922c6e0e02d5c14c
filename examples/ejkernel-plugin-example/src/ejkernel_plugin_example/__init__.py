"""ejkernel-plugin-example: a third-party ejkernel plugin (platform ``example``, op
``example_rms_norm``).

Importing this package is not needed to use the plugin: ejkernel discovers it through its
``ejkernel.plugins`` entry point. Import it for the new op's public function.
"""

from __future__ import annotations

from ejkernel_plugin_example.specs.example_rms_norm import ExampleRmsNorm, example_rms_norm

__version__ = "0.1.0"

__all__ = ["ExampleRmsNorm", "__version__", "example_rms_norm"]
