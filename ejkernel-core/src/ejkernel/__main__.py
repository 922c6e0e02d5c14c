"""``python -m ejkernel``: the ``ejkernel`` command."""

from __future__ import annotations

import sys

from ejkernel.cli import main

if __name__ == "__main__":
    sys.exit(main())
