"""What the metrics tests share: parsing an exposition, promtool, owners of resident models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from procs import Child, World, wait_until

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
RESIDENT_CHILD = Path(__file__).with_name("resident_child.py")
PROMTOOL_MISSING = (
    "promtool not found: it comes with Debian's 'prometheus' package, which 'make test' "
    "installs when it runs as root"
)


def parse(text: str) -> Samples:
    """Every sample, as prometheus_client's own parser reads the exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def promtool_check(text: str, *, required: bool = False) -> None:
    """``promtool check metrics`` (the exposition and its lint).  Where promtool is missing:
    the test skips when ``required``, else this check alone is passed over."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if required:
            pytest.skip(PROMTOOL_MISSING)
        return
    r = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


def start_owner(world: World, name: str, *specs: dict[str, Any]) -> dict[str, str]:
    """A ``resident_child.py`` owner of ``specs``; its resident ids once all are registered."""
    audit = world.root / f"{name}.audit"
    opts = json.dumps({"audit": str(audit), "residents": [{"weights_mb": 1, **s} for s in specs]})
    child = Child(world, name, [sys.executable, str(RESIDENT_CHILD), opts])
    world.children.append(child)

    def ready() -> dict[str, str] | None:
        if child.proc.poll() is not None:
            raise AssertionError(f"owner {name} exited\n{child.stderr()}")
        try:
            lines = audit.read_text().splitlines()
        except FileNotFoundError:
            return None
        for line in lines:
            kind, _, extra = line.split(" ", 2)
            if kind == "ready":
                ids: dict[str, str] = json.loads(extra)["ids"]
                return ids
        return None

    return wait_until(ready, 30.0, f"owner {name} to register its residents")
