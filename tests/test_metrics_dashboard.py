"""The Grafana dashboard (``gpulock files grafana``): importable as is, and asking only for
metrics we export.

Every query's metric names must be ones the exporter produces (``gpulock.metrics.specs``), so
a renamed metric cannot leave the dashboard silently empty; with promtool present, every
query must also parse as PromQL (as recording rules, Grafana's variables filled in).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from metrics_helpers import PROMTOOL_MISSING

from gpulock.metrics import specs

DASHBOARD = Path(__file__).resolve().parent.parent / "gpulock" / "share" / "grafana-dashboard.json"
NAME = re.compile(r"\bgpulock_[a-zA-Z0-9_:]*")
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m", "$gpu": ".*"}


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])  # a collapsed row keeps its panels inside
    return out


def exprs(d: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in panels(d) for t in p.get("targets", [])]
    found += [v["definition"] for v in d["templating"]["list"] if v.get("definition")]
    return found


def test_the_dashboard_is_importable_as_is() -> None:
    d = load()
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    assert d["__inputs"][0]["pluginId"] == "prometheus"
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["title"] and d["uid"] and d["id"] is None
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(d):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_every_query_names_only_metrics_the_exporter_produces() -> None:
    known = specs.names()
    for expr in exprs(load()):
        names = set(NAME.findall(expr))
        assert names, f"no gpulock metric in {expr!r}"
        assert names <= known, f"unknown metrics {sorted(names - known)} in {expr!r}"


def test_the_dashboard_covers_the_line_vram_residents_governor_evictions_and_spend() -> None:
    used = {n for e in exprs(load()) for n in NAME.findall(e)}
    for name in (
        "gpulock_queue_waiters",
        "gpulock_wait_seconds_bucket",
        "gpulock_gpu_memory_used_bytes",
        "gpulock_resident_bytes",
        "gpulock_governor_level_index",
        "gpulock_evictions_total",
        "gpulock_router_cloud_spend_today_usd",
        "gpulock_router_daily_budget_usd",
    ):
        assert name in used, name


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_MISSING)
    rules = []
    for i, expr in enumerate(exprs(load())):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        if expr.startswith("label_values("):  # Grafana's own function, not PromQL
            expr = expr[len("label_values(") :].split(",")[0]
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, timeout=60)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()
