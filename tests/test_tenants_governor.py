"""The governor sees tenant models through gpulock.arbiter and treats them like residents.

Unknown idle time never evicts (a model first seen has no known last use); a tenant's own
``min_idle`` applies; the ladder's force level may still take it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from standins.ollama import Ollama
from tenant_helpers import settings_for

from gpulock.core import events
from gpulock.governor.daemon import Governor
from gpulock.governor.model import GovernorConfig, GpuSignals, ResidentView, Snapshot, State
from gpulock.governor.policy import decide

GiB = 1024**3
REPO = Path(__file__).resolve().parent.parent


def view(rid: str, *, idle_known: bool, min_idle_s: float | None = None) -> ResidentView:
    return ResidentView(
        id=rid, name=rid, gpu=0, pid=0, policy="persistent", bytes=10 * GiB, in_use=False,
        last_used_wall=0.0, tenant="t", idle_known=idle_known, min_idle_s=min_idle_s,
    )  # fmt: skip


def test_policy_never_evicts_a_tenant_model_of_unknown_idle_time() -> None:
    snap = Snapshot(
        now_wall=10_000.0, local_minutes=600, gpus=(GpuSignals(0, 24 * GiB, 23 * GiB),),
        residents=(view("t/a", idle_known=False), view("t/b", idle_known=True)),
    )  # fmt: skip
    actions, _ = decide(snap, State(), GovernorConfig(min_idle_s=60), 10_000.0)
    assert [a.resident for a in actions if a.kind == "evict"] == ["t/b"]


def test_policy_uses_the_tenants_own_min_idle() -> None:
    snap = Snapshot(
        now_wall=1_000.0, local_minutes=600, gpus=(GpuSignals(0, 24 * GiB, 23 * GiB),),
        residents=(view("t/a", idle_known=True, min_idle_s=5_000.0),),
    )  # fmt: skip
    actions, _ = decide(snap, State(), GovernorConfig(min_idle_s=60), 1_000.0)
    assert [a for a in actions if a.kind == "evict"] == []


def test_the_watchdog_evicts_an_idle_tenant_model_once_its_idle_time_is_known(
    tmp_path: Path,
) -> None:
    srv = Ollama({"big:70b": 22 * GiB})
    srv.start()
    try:
        settings = settings_for(tmp_path, [{"name": "ollama", "kind": "ollama", "url": srv.url}])
        srv.load("big:70b")
        gov = Governor(settings, GovernorConfig(min_idle_s=0, threshold=0.85))
        gov.tick(gov.clock())  # first sighting: last use unknown, nothing evicted
        assert "big:70b" in srv.loaded
        gov.tick(gov.clock())  # unchanged since then: idle, over threshold -> evicted
        assert "big:70b" not in srv.loaded
        (ev,) = [e for e in events.read(settings.state_dir) if e["event"] == "evict"]
        assert (ev["tenant"], ev["outcome"]) == ("ollama", "freed")
        assert ev["reason"].startswith("governor evict")
    finally:
        srv.stop()


def test_governor_reaches_gpulock_only_through_the_arbiter() -> None:
    for name in ("effects.py", "probes.py"):
        tree = ast.parse((REPO / "gpulock" / "governor" / name).read_text())
        used = set()
        for node in ast.walk(tree):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("gpulock") and not module.startswith("gpulock.governor"):
                used.add(module)
                if node.module == "gpulock":
                    used |= {f"gpulock.{a.name}" for a in node.names}
        assert used <= {"gpulock", "gpulock.arbiter", "gpulock.core.units"}, (name, used)
