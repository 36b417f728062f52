"""``python -m gpulock.report``: the same as ``gpulock report``."""

from __future__ import annotations

import sys

from gpulock.report.cli import main

sys.exit(main())
