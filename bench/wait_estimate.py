"""The router's queue-wait estimate, replayed against recorded queues: old estimate vs new.

Run: ``.venv/bin/python bench/wait_estimate.py [--jobs N] [--events FILE] [--json FILE]``
(~1-2 min: it records a run first, unless ``--events`` names an event log to replay)

(1) Record: ``--jobs`` (250) real ``gpulock run`` jobs contend for a simulated 24 GiB GPU in a
    private state folder, arriving at random (seeded) times.  They recur under five names, each
    with its own length (0.15 s to 3 s, +-30 %) and ``--need`` (or none: exclusive), as cron
    jobs do.  Or ``--events FILE`` replays any event log (``.demo/state/events.jsonl`` after
    ``make demo``, a fleet's log).
(2) Replay: for every ticket that found someone ahead of it, the queue as it was at its arrival
    (who held, for how long already, who waited, their names and needs, from the ``acquire``
    and ``release`` events) and the holds released before it are given to both estimators:
    - old: one GPU-wide median of the last 20 holds; a holder past it counts 0 s remaining;
      one median per waiter ahead (gpulock/router/probe.py before this change, copied here);
    - new: ``gpulock.router.waitest.estimate_wait``: each ticket from its own name's holds, a
      holder's remaining time given how long it has held, the lock's sharing rule, at p90.
    Their prediction is set against the wait the ticket really had (``waited_s``).
(3) Deadline choices: for each such ticket and each deadline in DEADLINES_S the router would
    take the GPU when the prediction is within the deadline.  A choice is wrong when the GPU
    was taken and the real wait passed the deadline ("late": the agent waited its timeout out),
    or was refused though the real wait was within it ("sent away" needlessly).

Targets (new): <= 5 % wrong choices; the prediction covers >= 90 % of real waits.
Prints a table and a final ``summary:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpulock.router.waitest import Queued, estimate_wait, history_from  # noqa: E402

GiB = 1024**3
TOTAL = 24 * GiB
BUDGET = TOTAL - int(TOTAL * 0.10)  # the default 10 % reserve
DEFAULT_HOLD_S = 30.0  # router.hold_estimate's default
DEADLINES_S = (0.5, 1.0, 2.0, 4.0, 8.0)
TAIL_HOLDS = 300  # about what the probe's 64 KiB tail of the log holds
GRANT_SLACK_S = 0.1  # a real wait this much over the prediction still counts as covered
TARGET_WRONG = 0.05
TARGET_COVER = 0.90

# name: (mean hold s, need or None for exclusive, share of arrivals)
JOBS: dict[str, tuple[float, str | None, float]] = {
    "tagger": (0.15, "2GiB", 0.35),
    "embed": (0.3, "4GiB", 0.25),
    "digest": (0.8, None, 0.2),
    "tts": (1.5, "12GiB", 0.12),
    "render": (3.0, None, 0.08),
}


@dataclass(frozen=True, slots=True)
class Hold:
    seq: int
    name: str
    need_bytes: int | None
    arrival: float
    grant: float
    end: float
    waited_s: float


def record(tmp: Path, jobs: int, seed: int) -> Path:
    """Run ``jobs`` contending ``gpulock run`` jobs; return their event log."""
    state = tmp / "state"
    env = {**os.environ, "GPULOCK_STATE_DIR": str(state), "GPULOCK_SIMULATE": "24GiB"}
    env.pop("GPULOCK_TICKET", None)
    env.pop("GPULOCK_CONFIG", None)
    rng = random.Random(seed)
    names = list(JOBS)
    weights = [JOBS[n][2] for n in names]
    mean_hold = sum(JOBS[n][0] * JOBS[n][2] for n in names)
    gap = mean_hold / 0.9  # ~90 % busy: queues form and drain
    gpulock = [str(Path(sys.executable).parent / "gpulock")]
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    at = 0.0
    for _ in range(jobs):
        at += rng.expovariate(1 / gap)
        name = rng.choices(names, weights)[0]
        hold, need, _share = JOBS[name]
        secs = hold * rng.uniform(0.7, 1.3)
        argv = [*gpulock, "run", "--name", name, "--timeout", "10m"]
        if need:
            argv += ["--need", need]
        argv += ["--", "sleep", f"{secs:.3f}"]
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
    for p in procs:
        p.wait()
    return state / "events.jsonl"


def holds_of(log: Path, gpu: int = 0) -> list[Hold]:
    acq: dict[int, dict[str, Any]] = {}
    rel: dict[int, float] = {}
    for line in log.read_bytes().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict) or e.get("gpu") != gpu or not isinstance(e.get("ticket"), int):
            continue
        if e.get("event") == "acquire" and isinstance(e.get("waited_s"), int | float):
            acq[e["ticket"]] = e
        elif e.get("event") in ("release", "cleanup"):
            rel.setdefault(e["ticket"], float(e["ts"]))
    out = []
    for seq, e in acq.items():
        if seq not in rel:
            continue
        grant = float(e["ts"])
        out.append(
            Hold(
                seq,
                str(e.get("name") or ""),
                e.get("need_bytes"),
                grant - float(e["waited_s"]),
                grant,
                rel[seq],
                float(e["waited_s"]),
            )
        )
    return sorted(out, key=lambda h: h.seq)


def old_estimate(line: Sequence[Queued], holds: Sequence[float]) -> float:
    """gpulock/router/probe.py's estimate before this change (copied for the comparison)."""
    typical = statistics.median(holds[-20:]) if holds else DEFAULT_HOLD_S
    elapsed = [q.held_s for q in line if q.held_s is not None]
    waiters = sum(1 for q in line if q.held_s is None)
    remaining = max((max(0.0, typical - e) for e in elapsed), default=0.0)
    return remaining + waiters * typical


def shares(line: Sequence[Queued], need: int | None) -> bool:
    """choose._shares, which both estimators sit behind: room next to the holders now."""
    if need is None or any(q.held_s is None or q.need_bytes is None for q in line):
        return False
    return sum(q.need_bytes or 0 for q in line) + need <= BUDGET


def replay(holds: list[Hold]) -> list[dict[str, Any]]:
    rows = []
    for x in holds:
        t = x.arrival
        line = [
            Queued(y.name, y.need_bytes, t - y.grant if y.grant <= t else None)
            for y in holds
            if y.seq < x.seq and y.end > t
        ]
        if not line:
            continue
        line.sort(key=lambda q: q.held_s is None)
        done = sorted((y for y in holds if y.end <= t), key=lambda y: y.end)[-TAIL_HOLDS:]
        pairs = [(y.name, y.end - y.grant) for y in done]
        history = history_from(pairs, DEFAULT_HOLD_S)
        if shares(line, x.need_bytes):
            old = new = 0.0
        else:
            old = old_estimate(line, [h for _n, h in pairs])
            new = estimate_wait(line, history, need_bytes=x.need_bytes, budget_bytes=BUDGET)
        rows.append(
            {
                "name": x.name,
                "ahead": len(line),
                "actual": x.waited_s,
                "old": old,
                "new": new,
                # every name in line has held before: past the first minutes of a new log
                "warm": all(q.name in history.by_name for q in line),
            }
        )
    return rows


def score(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    late = away = total = 0
    for r in rows:
        for d in DEADLINES_S:
            total += 1
            take = r[key] <= d
            if take and r["actual"] > d:
                late += 1
            elif not take and r["actual"] <= d:
                away += 1
    errors = [abs(r[key] - r["actual"]) for r in rows]
    return {
        "late": late / total,
        "away": away / total,
        "wrong": (late + away) / total,
        "cover": sum(1 for r in rows if r["actual"] <= r[key] + GRANT_SLACK_S) / len(rows),
        "abs_err_p50": statistics.median(errors),
        "pred_p50": statistics.median(r[key] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=250, help="jobs recorded (1)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--events", metavar="FILE", help="replay this event log instead")
    ap.add_argument("--save-events", metavar="FILE", help="keep the recorded event log")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpulock-bench-wait-") as tmp:
        log = Path(args.events) if args.events else record(Path(tmp), args.jobs, args.seed)
        holds = holds_of(log)
        if args.save_events:
            Path(args.save_events).write_bytes(log.read_bytes())
    rows = replay(holds)
    if not rows:
        print("no ticket found anyone ahead of it: nothing to replay")
        return 1
    warm = [r for r in rows if r["warm"]]
    old, new = score(warm, "old"), score(warm, "new")
    old_all, new_all = score(rows, "old"), score(rows, "new")
    actual_p50 = statistics.median(r["actual"] for r in rows)
    source = args.events or f"{args.jobs} recorded `gpulock run` jobs"
    print(
        f"wait-estimate benchmark: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.2f}; {source} in {time.monotonic() - t0:.0f} s; "
        f"{len(rows)} of {len(holds)} tickets found a queue ({len(warm)} after warm-up: every "
        f"name in line had held before); deadlines {DEADLINES_S} s"
    )
    print(
        f"  {'estimator':<34}{'pred p50':>9}{'|err| p50':>10}{'covers':>8}{'late':>7}"
        f"{'sent away':>10}{'wrong':>7}"
    )
    table = (
        ("old: GPU median of last 20 holds", old),
        ("new: per name, conditional, p90", new),
        ("old, warm-up included", old_all),
        ("new, warm-up included", new_all),
    )
    for label, s in table:
        print(
            f"  {label:<34}{s['pred_p50']:>8.2f}s{s['abs_err_p50']:>9.2f}s{s['cover']:>8.1%}"
            f"{s['late']:>7.1%}{s['away']:>10.1%}{s['wrong']:>7.1%}"
        )
    print(
        f"  (real wait p50 {actual_p50:.2f} s; covers: real wait <= prediction + "
        f"{GRANT_SLACK_S:g} s of grant latency; late/sent away/wrong: shares of "
        f"ticket x deadline choices)"
    )
    targets = [
        (f"<= {TARGET_WRONG:.0%} wrong", new["wrong"] <= TARGET_WRONG),
        (f">= {TARGET_COVER:.0%} covered", new["cover"] >= TARGET_COVER),
    ]
    missed = [name for name, met in targets if not met]
    verdict = (
        "PASS: targets " + ", ".join(name for name, _ in targets)
        if not missed
        else "FAILED: " + ", ".join(missed)
    )
    print(
        f"\nsummary: wrong deadline choices {new['wrong']:.1%} new vs {old['wrong']:.1%} old "
        f"(late {new['late']:.1%} vs {old['late']:.1%}, sent away {new['away']:.1%} vs "
        f"{old['away']:.1%}); prediction covers {new['cover']:.1%} of real waits vs "
        f"{old['cover']:.1%}; {len(warm)} queued tickets after warm-up "
        f"({verdict})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"old": old, "new": new, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
