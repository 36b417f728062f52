"""Where the files that ship inside the package lie (``gpulock/share/``): the systemd units, the
Grafana dashboard, crontab.example and the tour's examples.  ``gpulock files`` lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Final

SHARE: Final = Path(__file__).resolve().parents[1] / "share"
EXAMPLES: Final = SHARE / "examples"
