"""``python -m gpulock.agents ...``: the same command as ``gpulock agent ...``."""

from __future__ import annotations

import sys

from gpulock.agents.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m gpulock.agents"))
