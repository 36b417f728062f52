"""`make demo`, short: the fleet of twenty agents, the governor, three tiers, the report."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from procs import wait_until

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_short_demo_runs_the_fleet_and_writes_the_report(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    report = tmp_path / "demo-report.html"
    argv = ["--seconds", "26", "--dir", str(tmp_path / "d"), "--report", str(report)]
    r = subprocess.run(
        [sys.executable, "-m", "gpulock.agents.demo", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    progress, summary = r.stdout.split("\nsummary\n", 1)
    shown = progress.splitlines()
    assert all(a != b for a, b in itertools.pairwise(shown)), progress  # no repeats
    for heading in ("GPU handoffs:", "waits:", "runs:", "evictions:", "route choices by tier:"):
        assert heading in summary, summary

    log = tmp_path / "d" / "state" / "events.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    errors = [e for e in events if e["event"] == "agent" and e["outcome"] == "error"]
    # Every agent of the demo works; a crash is a bug, shown with its traceback from the
    # agent's own log so that a failure seen once (on CI) can be read, not guessed at.
    assert errors == [], [*errors, *_tracebacks(tmp_path / "d" / "state", errors)]
    runs = [e for e in events if e["event"] == "fleet-run"]
    # What happened, not how much fit in a window: the demo runs its fleet on past --seconds
    # until every agent has run once, however loaded the machine is.
    from gpulock.agents.demo import FLAKY
    from gpulock.agents.demo_agents import VARIANTS

    assert {e["agent"] for e in runs} == {*VARIANTS, FLAKY}, sorted({e["agent"] for e in runs})
    missed = [e for e in events if e["event"] == "fleet-missed"]
    assert ("missed fires:" in summary) == bool(missed), (summary, len(missed))
    assert len({e["pid"] for e in runs}) == len(runs)  # every run its own process
    tiers = Counter(e["tier"] for e in events if e["event"] == "call" and e["ok"])
    assert {"gpu", "cpu", "cloud"} <= set(tiers), tiers
    # flaky-gpu dies by SIGKILL holding the GPU on its first run; the line recovers from it
    # without any watchdog: the next reader of the queue cleans the dead ticket up.
    assert any(e["event"] == "cleanup" and e.get("holding") for e in events), "no recovery"
    assert any(e["event"] == "acquire" for e in events)

    html = report.read_text()
    assert html.lower().startswith("<!doctype html>") and 'class="hold' in html


def test_the_demos_words_about_its_governor_match_the_config_it_runs(tmp_path: Path) -> None:
    """The governor of the demo climbs, under its busy minute, as far as ``freeze`` and back:
    the docstring and getting-started say so, with the thresholds the demo's config sets."""
    import yaml

    from gpulock.agents import demo

    cfg = yaml.safe_load(demo._config(tmp_path, tmp_path / "m.gguf", 9, None))
    watchdog, governor = cfg["watchdog"], cfg["governor"]
    pressure = int(str(governor["vram_pressure"]).rstrip("%"))
    threshold = int(str(watchdog["threshold"]).rstrip("%"))
    cooldown = int(str(governor["cooldown"]).rstrip("s"))
    doc = " ".join((demo.__doc__ or "").split())
    guide = " ".join((REPO / "docs" / "getting-started.md").read_text().split())
    for text in (doc, guide):
        assert f"over {pressure} %" in text, text
        assert f"per {cooldown} s of clear signals" in text, text
        for level in ("reduce", "evict-idle", "force-evict", "freeze"):
            assert level in text, (level, text)
    assert f"passes {threshold} %" in doc
    assert "climbs to ``reduce``" not in doc  # what it said while the run went on to freeze


def test_the_assistant_may_wait_in_line_for_its_whole_run() -> None:
    from gpulock.agents import demo_agents
    from gpulock.agents.spec import get

    spec = get("assistant")
    assert spec is not None and spec.func is demo_agents.assistant
    # Its waits are bounded by start + timeout: the demo runs it for --seconds - 5 (60 s by
    # default), and a GPU call past the deadline could not queue at all.
    assert spec.timeout_s is not None and spec.timeout_s >= 60


def _started_by(state: Path) -> list[str]:
    """The processes whose environment names ``state`` (all the demo started): pid and argv."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"GPULOCK_STATE_DIR={state}\0".encode() in environ.read_bytes():
                argv = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{environ.parent.name} {argv.decode(errors='replace')[:120]}")
        except OSError:  # gone, or not ours
            continue
    return found


# A stand-in for the demo: its signal handler, then one child started the way it starts them.
# argv[1] says what happened first: "stopping" (the demo already had a SIGTERM, so it ignores
# more), "racing" (a SIGTERM lands in the child before its set-up) or "plain".
_STAND_IN = """
import os, signal, subprocess, sys
from gpulock.agents import demo

signal.signal(signal.SIGTERM, demo._on_signal)
if sys.argv[1] == "stopping":
    os.kill(os.getpid(), signal.SIGTERM)
    while signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        pass
setup = demo._child_setup()

def racing() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # runs the demo's handler, in the child
    setup()

p = subprocess.Popen(
    ["sleep", "120"], preexec_fn=racing if sys.argv[1] == "racing" else setup,
    start_new_session=True, stdout=subprocess.DEVNULL,
)
print(p.pid, flush=True)
if sys.argv[1] == "racing":
    print(p.wait(30), flush=True)
sys.stdin.read()  # until the test is done with the child
"""


def _ignored(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn for {pid}")


@pytest.mark.parametrize("first", ["plain", "stopping", "racing"])
def test_what_the_demo_starts_can_be_stopped_and_dies_with_it(first: str) -> None:
    children: list[int] = []
    stand_in = subprocess.Popen(
        [sys.executable, "-c", _STAND_IN, first],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert stand_in.stdout is not None
        child = int(stand_in.stdout.readline() or b"0")
        assert child, "the stand-in did not start its child"
        children.append(child)
        if first == "racing":  # the signal was the child's: it ends, as SIGTERM says
            assert int(stand_in.stdout.readline() or b"0") == -signal.SIGTERM
            return
        # An ignored SIGTERM or SIGHUP would survive exec: such a child could not be stopped.
        stop_bits = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
        assert _ignored(child) & stop_bits == 0, hex(_ignored(child))
        # The demo dies by SIGKILL: the kernel stops the child (Linux), no clean-up needed.
        stand_in.kill()
        stand_in.wait()
        wait_until(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), 15, "the child")
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
        for pid in children:  # a failed run must not leave its sleep behind
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_demo_leaves_nothing_running(tmp_path: Path, sig: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    folder = tmp_path / "d"
    out = tmp_path / "out.txt"
    argv = ["--seconds", "60", "--dir", str(folder), "--report", str(tmp_path / "r.html")]
    with open(out, "wb") as f:
        demo = subprocess.Popen(
            [sys.executable, "-m", "gpulock.agents.demo", *argv],
            cwd=tmp_path,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The cloud server answers and the governor runs; the fleet starts right after.
        wait_until(lambda: b"governor: running" in out.read_bytes(), 60, out.read_text)
        demo.send_signal(sig)
        code = demo.wait(60)  # fleet grace 4 s, then at most 4 x STOP_WAIT_S: well inside
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    # SIGTERM: the demo unwinds and stops what it started; SIGKILL: the kernel tells them.
    assert code == (128 + sig if sig == signal.SIGTERM else -sig), out.read_text()
    if sig == signal.SIGTERM:
        assert "demo stopped by SIGTERM" in out.read_text() and "Traceback" not in out.read_text()
    state = folder / "state"
    wait_until(lambda: not _started_by(state), 30, lambda: f"left running: {_started_by(state)}")


def _tracebacks(state: Path, errors: list[dict[str, object]]) -> list[str]:
    """The ``exc`` of each failed run in its agent's log (``<state>/agents/<name>/log.jsonl``)."""
    out = []
    for e in errors:
        log = state / "agents" / str(e["agent"]) / "log.jsonl"
        for line in log.read_text().splitlines() if log.exists() else []:
            rec = json.loads(line)
            if rec.get("pid") == e.get("pid") and rec.get("exc"):
                out.append(f"{e['agent']} pid {e['pid']}:\n{rec['exc']}")
    return out
