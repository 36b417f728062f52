"""``make demo``: a dozen agents queue for one simulated 24 GiB GPU, and one of them crashes.

Every agent is a real process started through ``gpulock run`` (exactly what a cron line does);
its "GPU work" is a short sleep.  The demo uses its own state folder (``.demo/state``), so it
never touches a real queue, and prints who got the GPU in what order, how long each waited,
which ones shared the GPU by VRAM, which one gave up (exit 75) and how the line recovered from
an agent killed with SIGKILL while holding the GPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulock import events
from gpulock.units import format_duration, format_size, parse_size


@dataclass(frozen=True, slots=True)
class DemoAgent:
    name: str
    work_s: float
    need: str | None = None  # None: exclusive
    timeout_s: float | None = None
    crash: bool = False  # SIGKILLed while it holds the GPU


AGENTS = (
    DemoAgent("digest-07h", 0.6),
    DemoAgent("inbox-triage", 0.3, need="6GiB"),
    DemoAgent("doc-tagger", 0.3, need="6GiB"),
    DemoAgent("tts-batch", 0.5, need="16GiB"),
    DemoAgent("report-draft", 0.4),
    DemoAgent("crashy-agent", 30.0, crash=True),
    DemoAgent("summarize-a", 0.2, need="4GiB"),
    DemoAgent("summarize-b", 0.2, need="4GiB"),
    DemoAgent("summarize-c", 0.2, need="4GiB"),
    DemoAgent("impatient", 0.2, timeout_s=0.5),
    DemoAgent("classifier", 0.3, need="2GiB"),
    DemoAgent("nightly-embed", 0.4),
)


def main() -> int:
    root = Path(".demo").absolute()
    state = root / "state"
    shutil.rmtree(state, ignore_errors=True)
    root.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, GPULOCK_STATE_DIR=str(state), GPULOCK_SIMULATE="24GiB")
    env.pop("GPULOCK_TICKET", None)
    print(f"{len(AGENTS)} agents queue for one simulated 24 GiB GPU (state folder {state})\n")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    for agent in AGENTS:
        cmd = [sys.executable, "-m", "gpulock", "run", "--name", agent.name]
        if agent.need:
            cmd += ["--need", agent.need]
        if agent.timeout_s is not None:
            cmd += ["--timeout", str(agent.timeout_s)]
        cmd += ["--", sys.executable, "-c", f"import time; time.sleep({agent.work_s})"]
        procs[agent.name] = subprocess.Popen(
            cmd, env=env, stderr=subprocess.PIPE, start_new_session=True
        )
        _wait_for_tickets(state, len(procs))  # arrival order = the order above
    crashy = next(a for a in AGENTS if a.crash)
    _wait_for_event(state, "acquire", crashy.name)
    os.killpg(procs[crashy.name].pid, signal.SIGKILL)  # the whole agent dies, mid-hold
    killed_at = time.time()
    codes = {name: p.wait(timeout=120) for name, p in procs.items()}
    elapsed = time.monotonic() - t0
    _report(state, codes, procs, killed_at, elapsed)
    return 0


def _wait_for_tickets(state: Path, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {e["ticket"] for e in events.read(state) if e["event"] in ("wait", "acquire")}
        if len(seen) >= n:
            return
        time.sleep(0.005)


def _wait_for_event(state: Path, kind: str, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e["event"] == kind and e.get("name") == name for e in events.read(state)):
            return
        time.sleep(0.005)
    raise SystemExit(f"demo: {name} never got the GPU")


def _report(
    state: Path,
    codes: dict[str, int],
    procs: dict[str, subprocess.Popen[bytes]],
    killed_at: float,
    elapsed: float,
) -> None:
    log = list(events.read(state))
    by_name: dict[str, dict[str, Any]] = {}
    for e in log:
        rec = by_name.setdefault(e.get("name", "?"), {})
        rec.setdefault(e["event"], e)
    needs = {a.name: a.need for a in AGENTS}
    grants = sorted((e for e in log if e["event"] == "acquire"), key=lambda e: float(e["ts"]))
    print(f"{'#':>2}  {'AGENT':<14} {'TICKET':>6}  {'NEED':<10} {'WAITED':>8}  OUTCOME")
    for i, g in enumerate(grants, 1):
        name = g["name"]
        want = needs.get(name)
        need = format_size(parse_size(want)) if want else "exclusive"
        outcome = _outcome(name, codes.get(name), by_name[name])
        print(
            f"{i:>2}  {name:<14} {g['ticket']:>6}  {need:<10} "
            f"{format_duration(g['waited_s']):>8}  {outcome}"
        )
    for name, rec in by_name.items():
        if "timeout" in rec:
            stream = procs[name].stderr
            err = stream.read().decode().strip() if stream is not None else ""
            print(
                f" -  {name:<14} {rec['timeout']['ticket']:>6}  gave up after "
                f"{format_duration(rec['timeout']['waited_s'])}, exit {codes[name]} "
                f"(cron tries again next run)"
            )
            if err:
                print(f"      {err.splitlines()[0]}")
    after = [g for g in grants if float(g["ts"]) >= killed_at]
    if after:
        print(
            f"\nafter the SIGKILL, {after[0]['name']} got the GPU "
            f"{(float(after[0]['ts']) - killed_at) * 1000:.1f} ms later; no watchdog ran"
        )
    cleanups = [e for e in log if e["event"] == "cleanup"]
    if cleanups:
        print(f"the dead agent's ticket was removed by {len(cleanups)} waiter(s)")
    print(
        f"\n{len(grants)} grants, peak {_peak(log)} holders at once (VRAM sharing), "
        f"{elapsed:.1f} s in all.  See: GPULOCK_STATE_DIR={state} gpulock history"
    )


def _outcome(name: str, code: int | None, rec: dict[str, Any]) -> str:
    if code == -signal.SIGKILL:
        return "killed (SIGKILL) while holding"
    held = rec.get("release", {}).get("held_s")
    return f"ran {format_duration(held)}, exit {code}" if held is not None else f"exit {code}"


def _peak(log: list[dict[str, Any]]) -> int:
    holding: set[int] = set()
    peak = 0
    for e in sorted(log, key=lambda e: float(e["ts"])):
        if e["event"] == "acquire":
            holding.add(e["ticket"])
        elif e["event"] in ("release", "cleanup"):
            holding.discard(e["ticket"])
        peak = max(peak, len(holding))
    return peak


if __name__ == "__main__":
    sys.exit(main())
