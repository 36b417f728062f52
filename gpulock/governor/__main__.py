"""``python -m gpulock.governor``: the same as ``gpulock governor``."""

from __future__ import annotations

import sys

from gpulock.governor.cli import main

if __name__ == "__main__":
    sys.exit(main())
