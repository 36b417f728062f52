#!/usr/bin/env python3
"""``gpulock pool`` against fixed worker counts, on a simulated 24 GiB GPU with other jobs.

Seed 003's batch: every worker loads its own copy of a model (``--load`` seconds, 8.9 GiB), then
works through the batch's items (``--item`` seconds each, the GPU held all along) taken from a
shared folder (claimed by ``rename``, so each item is done once), and exits 0 when none is left.
Three ways to run it, each from a fresh state folder, side by side:

* ``auto``: ``gpulock pool --need 8.9GiB -- worker``: as many workers as the line admits;
* ``fixed 1``: one ``gpulock run --need 8.9GiB -- worker``;
* ``fixed 3``: three such runs started at once: more than fit, so some wait in line.

Scenarios (other jobs on the same GPU, a process of their own taking the real line):

* ``quiet``: nothing else;
* ``6GiB on/off``: a 6 GiB job holds for 1 s, then is away for 1 s, again and again;
* ``exclusive``: a job that takes the whole GPU for 0.5 s every 2 s.

Figures: items per minute (items / wall time from the first start to the last worker's end)
and over-commits: workers started while the GPU had no room for them (each had to wait in the
line after its process started; on a GPU without a lock, each would have hit out-of-memory).
A worker of ``auto`` starts only once its ticket is granted, so it has none by construction;
the bench counts them anyway, from the event log (``wait`` events of worker tickets).

    python bench/pool.py            # about a minute on 2 cores
    python bench/pool.py --items 20 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NEED = "8.9GiB"

WORKER_PY = """\
import os, sys, time
d, load_s, item_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
time.sleep(load_s)  # the model loads
while True:
    items = sorted(os.listdir(os.path.join(d, "todo")))
    if not items:
        break
    try:
        os.rename(os.path.join(d, "todo", items[0]), os.path.join(d, "done", items[0]))
    except FileNotFoundError:
        continue
    time.sleep(item_s)  # the item's work, on the GPU
"""

OTHER_PY = """\
import os, sys, time
import gpulock
stop, need, on_s, off_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
while not os.path.exists(stop):
    with gpulock.acquire(need=None if need == "-" else need, name="other"):
        time.sleep(on_s)
    time.sleep(off_s)
"""

SCENARIOS = {
    "quiet": None,
    "6GiB on/off": ("6GiB", 1.0, 1.0),
    "exclusive": ("-", 0.5, 1.5),
}
STRATEGIES = ("auto", "fixed 1", "fixed 3")


@dataclass
class Outcome:
    items_per_min: float
    over_commits: int


def run_one(
    root: Path, strategy: str, scenario: str, items: int, load_s: float, item_s: float
) -> Outcome:
    work = Path(tempfile.mkdtemp(dir=root))
    state = work / "state"
    batch = work / "batch"
    for sub in ("todo", "done"):
        (batch / sub).mkdir(parents=True)
    for i in range(items):
        (batch / "todo" / f"item-{i:04d}").touch()
    worker = work / "worker.py"
    worker.write_text(WORKER_PY)
    other_py = work / "other.py"
    other_py.write_text(OTHER_PY)
    env = dict(os.environ)
    env.update(
        GPULOCK_SIMULATE="24GiB",
        GPULOCK_STATE_DIR=str(state),
        GPULOCK_CONFIG=str(work / "none.yaml"),
        PYTHONPATH=str(REPO),
    )
    env.pop("GPULOCK_TICKET", None)
    (work / "none.yaml").write_text("{}\n")
    gl = [sys.executable, "-m", "gpulock"]
    cmd = [sys.executable, str(worker), str(batch), str(load_s), str(item_s)]
    other = None
    stop = work / "stop"
    if SCENARIOS[scenario] is not None:
        need, on_s, off_s = SCENARIOS[scenario]  # type: ignore[misc]
        other = subprocess.Popen(
            [sys.executable, str(other_py), str(stop), need, str(on_s), str(off_s)], env=env
        )
        gpu0 = state / "gpu0"
        deadline = time.monotonic() + 10
        while not (gpu0.exists() and any(gpu0.glob("*.ticket"))):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # let the other job be in the line first
    start = time.monotonic()
    if strategy == "auto":
        procs = [
            subprocess.Popen([*gl, "pool", "--need", NEED, "--name", "worker", "--", *cmd], env=env)
        ]
    else:
        n = int(strategy.split()[1])
        procs = [
            subprocess.Popen([*gl, "run", "--need", NEED, "--name", "worker", "--", *cmd], env=env)
            for _ in range(n)
        ]
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - start
    stop.touch()
    if other is not None:
        other.wait()
    events = []
    log = state / "events.jsonl"
    if log.exists():
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    granted = {
        e["ticket"]: e["ts"]
        for e in events
        if e["event"] == "acquire" and e.get("name") == "worker"
    }
    if strategy == "auto":
        # A worker process starts once its ticket is granted: an over-commit would be one
        # that started before its grant.
        starts = [e for e in events if e["event"] == "pool-worker" and e["action"] == "start"]
        over = sum(1 for e in starts if e["ts"] < granted.get(e["ticket"], float("inf")))
    else:
        # `gpulock run` starts with the worker's process: one that had to wait in line was
        # started without room on the GPU.
        waited = {e["ticket"] for e in events if e["event"] == "wait" and e.get("name") == "worker"}
        over = len(set(granted) & waited)
    if any(codes):
        raise SystemExit(f"{strategy}/{scenario}: exit codes {codes}")
    shutil.rmtree(work, ignore_errors=True)
    return Outcome(items / wall * 60, over)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=40, help="items in the batch (default 40)")
    ap.add_argument("--load", type=float, default=0.5, help="a worker's model load, s (0.5)")
    ap.add_argument("--item", type=float, default=0.1, help="one item's work, s (0.1)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell, best kept (default 1)")
    ap.add_argument("--quick", action="store_true", help="the quiet scenario only")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    scenarios = ["quiet"] if args.quick else list(SCENARIOS)
    results: dict[tuple[str, str], Outcome] = {}
    try:
        for scenario in scenarios:
            for strategy in STRATEGIES:
                runs = [
                    run_one(root, strategy, scenario, args.items, args.load, args.item)
                    for _ in range(args.repeat)
                ]
                best = max(runs, key=lambda o: o.items_per_min)
                results[(scenario, strategy)] = best
                print(
                    f"  {scenario:<12} {strategy:<8} {best.items_per_min:7.1f} items/min",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"gpulock pool vs fixed worker counts: {args.items} items, load {args.load:g} s, "
        f"item {args.item:g} s, need {NEED} on a simulated 24 GiB GPU (10 % reserve)"
    )
    head = f"{'scenario':<13}" + "".join(
        f"{s + ' items/min':>20}{'over-commits':>14}" for s in STRATEGIES
    )
    print(head)
    verdicts = []
    for scenario in scenarios:
        row = f"{scenario:<13}"
        for strategy in STRATEGIES:
            o = results[(scenario, strategy)]
            row += f"{o.items_per_min:>20.1f}{o.over_commits:>14d}"
        print(row)
        auto = results[(scenario, "auto")]
        best_fixed = max(results[(scenario, s)].items_per_min for s in STRATEGIES[1:])
        verdicts.append((scenario, auto.items_per_min / best_fixed, auto.over_commits))
    parts = ", ".join(f"{s} {r:.2f}x" for s, r, _ in verdicts)
    total_oc = sum(oc for _, _, oc in verdicts)
    fixed3_oc = sum(results[(s, "fixed 3")].over_commits for s in scenarios)
    missed = [f"{s} below best fixed within 3 %" for s, r, _ in verdicts if r < 0.97]
    missed += [f"{s} over-commits" for s, _, oc in verdicts if oc]
    print(
        f"summary: auto vs best fixed count: {parts}; over-commits auto {total_oc}, "
        f"fixed 3 {fixed3_oc}; target (>= best fixed within 3 %, 0 over-commits) "
        + ("met" if not missed else "NOT met: " + ", ".join(missed))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
