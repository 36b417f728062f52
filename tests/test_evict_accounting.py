"""What an eviction says it freed: only what a probe saw come back counts as freed (event,
report, metrics), and a tenant model whose server's pid is unknown has no pid (never ``0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Cli
from standins.ollama import Ollama
from tenant_helpers import write_config

from gpulock.report import build, summary_lines

GiB = 1024**3
T0 = 1_790_000_000.0


def ev(t: float, kind: str, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + t, "event": kind, **fields}


def test_the_report_counts_only_verified_frees_as_freed() -> None:
    events = [
        ev(0, "resident", resident="r1", name="a", gpu=0, pid=5, declared_bytes=GiB),
        ev(0, "resident", resident="r2", name="b", gpu=0, pid=5, declared_bytes=GiB),
        ev(0, "resident", resident="r3", name="c", gpu=0, pid=6, declared_bytes=GiB),
        ev(1, "evict", resident="r1", name="a", gpu=0, pid=5, outcome="freed", freed_bytes=GiB),
        # No probe could confirm it: an old log line still carries freed_bytes, a new one not.
        ev(2, "evict", resident="r2", name="b", gpu=0, pid=5, outcome="unloaded", freed_bytes=GiB),
        ev(
            3,
            "evict",
            resident="r3",
            name="c",
            gpu=0,
            pid=6,
            outcome="owner-gone",
            freed_bytes=None,
            declared_bytes=GiB,
        ),
    ]
    data = build(events)
    assert (data.totals.evictions, data.totals.evictions_freed) == (3, 1)
    assert "evictions: 3 (1 freed memory)" in summary_lines(data)
    # The models left all the same: none is drawn as resident to the end of the log.
    assert sorted(r.end for r in data.residencies) == ["evict", "evict", "evict"]


def test_metrics_count_only_verified_bytes() -> None:
    pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")
    from gpulock.metrics.tally import Tally, fold

    t = Tally()
    for e in (
        {"event": "evict", "reason": "requested", "outcome": "freed", "freed_bytes": GiB},
        {"event": "evict", "reason": "requested", "outcome": "unloaded", "freed_bytes": 2 * GiB},
        {"event": "evict", "reason": "requested", "outcome": "owner-gone", "freed_bytes": GiB},
    ):
        fold(t, e)
    assert t.counters["gpulock_evicted_bytes"] == {("request", ""): GiB}


def test_a_tenant_model_without_a_known_pid_is_evicted_without_pid_0(
    cli: Cli, tmp_path: Path
) -> None:
    o = Ollama({"qwen2.5:7b": 5 * GiB}).start()
    try:
        cfg = write_config(tmp_path, [{"name": "ollama", "kind": "ollama", "url": o.url}])
        env = cli.env(GPULOCK_CONFIG=str(cfg))
        o.load("qwen2.5:7b")
        r = cli.run("evict", "ollama/qwen2.5:7b", env=env)
        assert r.code == 0, r.describe()
        assert r.stdout.startswith("qwen2.5:7b (ollama/qwen2.5:7b, gpu0): freed: "), r.describe()
        assert "pid" not in r.stdout, r.describe()
        (e,) = cli.events("evict")
        assert "pid" not in e and e["tenant"] == "ollama", e

        o.load("qwen2.5:7b")
        r = cli.run("evict", "ollama/qwen2.5:7b", "--json", env=env)
        assert r.code == 0, r.describe()
        (res,) = r.json()["results"]
        assert res["pid"] is None and res["outcome"] == "freed", res
        h = cli.run("history", "--event", "evict", env=env)
        assert "[0]" not in h.stdout and "qwen2.5:7b" in h.stdout, h.describe()
    finally:
        o.stop()
