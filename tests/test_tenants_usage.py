"""Last use of tenant models, which no server reports (gpulock.tenants.usage), and the time
format Ollama writes."""

from __future__ import annotations

from pathlib import Path

from tenant_helpers import settings_for

from gpulock.tenants import usage
from gpulock.tenants.ollama import parse_time


def test_first_sighting_is_unknown_then_idle_since_then_then_used_when_it_changes(
    tmp_path: Path,
) -> None:
    s = settings_for(tmp_path, [])
    asked = frozenset({"o"})
    first = usage.observe(s, {"o/m": "a"}, 100.0, asked=asked)
    assert first.last_used == {"o/m": None} and first.appeared == ("o/m",)
    same = usage.observe(s, {"o/m": "a"}, 200.0, asked=asked)
    assert same.last_used == {"o/m": 100.0} and same.appeared == ()  # idle at least since 100
    assert same.bounded == {"o/m"} and usage.peek(s).bounded == {"o/m"}  # no use seen yet
    used = usage.observe(s, {"o/m": "b"}, 300.0, asked=asked)
    assert used.last_used == {"o/m": 300.0} and used.bounded == frozenset()
    usage.touch(s, "o/m", 350.0)
    assert usage.observe(s, {"o/m": "b"}, 400.0, asked=asked).last_used == {"o/m": 350.0}


def test_a_tenant_that_did_not_answer_keeps_its_history(tmp_path: Path) -> None:
    s = settings_for(tmp_path, [])
    usage.observe(s, {"o/m": "a", "l/x": "1"}, 100.0, asked=frozenset({"o", "l"}))
    obs = usage.observe(s, {"o/m": "a"}, 200.0, asked=frozenset({"o"}))  # l did not answer
    assert obs.vanished == ()
    assert usage.peek(s).last_used["l/x"] is None and "l/x" in usage.peek(s).last_used
    gone = usage.observe(s, {}, 300.0, asked=frozenset({"o", "l"}))
    assert sorted(gone.vanished) == ["l/x", "o/m"]


def test_garbage_in_the_usage_file_is_ignored(tmp_path: Path) -> None:
    s = settings_for(tmp_path, [])
    (s.state_dir / "tenants").mkdir(mode=0o700)
    (s.state_dir / "tenants" / "usage.json").write_text('{"format": "x", "models": [1, 2]}')
    assert usage.observe(s, {"o/m": "a"}, 1.0, asked=frozenset({"o"})).last_used == {"o/m": None}


def test_ollama_times_with_nanoseconds_and_offsets() -> None:
    assert parse_time("2024-06-04T14:38:31.83753-07:00") == 1717537111.83753
    assert parse_time("2025-01-01T00:00:00.123456789Z") == 1735689600.123456
    assert parse_time("0001-01-01T00:00:00Z") is not None
    assert parse_time("not a time") is None and parse_time(None) is None
