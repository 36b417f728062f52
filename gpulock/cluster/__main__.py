"""``python -m gpulock.cluster``: the same as ``gpulock cluster``."""

from __future__ import annotations

import sys

from gpulock.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
