"""Helpers for the tenant tests: a config naming tenants, and settings to use it in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpulock.core import settings as settings_mod
from gpulock.core.settings import Settings


def write_config(root: Path, tenants: list[dict[str, Any]], **top: Any) -> Path:
    path = root / "gpulock.yaml"
    doc = {"simulate": "24GiB", **top, "tenants": tenants}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def settings_for(root: Path, tenants: list[dict[str, Any]], **top: Any) -> Settings:
    cfg = write_config(root, tenants, **top)
    state = root / "state"
    return settings_mod.load(str(cfg), state)
