"""Eviction policies side by side on three simulated days, and the cost of one decision.

Run: ``.venv/bin/python bench/replay.py [--hours 24] [--json FILE]``

Three workloads shaped after the seeds, each a simulated day replayed by ``gpulock replay``'s
simulator (``gpulock.replay_sim``: the lock's own ``decide`` and the live victim order):

* ``cron-6GB`` (periodic): 50 cron agents on a 6 GiB GPU, eight small models (1-2.5 GiB),
  each agent every 15 minutes to 2 hours with its model, 5-30 s a run;
* ``pool-96GB`` (periodic): a 96 GiB GPU with a resident pool of twelve 6-16 GiB models used
  by periodic agents, and a large exclusive job (its own 40 GiB model) every 3 hours;
* ``bursty-12GB``: a 12 GiB GPU, six 2-5 GiB models asked for in bursts at random times (HTTP
  agents through ``gpulock serve``: no schedule declares them).

Per workload and policy: GiB reloaded and total wait (seconds).  Targets (issue 19):
``foresight`` within 1.2x of ``belady`` on GiB reloaded everywhere, and at least 30 % fewer GiB
reloaded than ``lru`` on the periodic ones.  Then the cost of one decision
(``gpulock.core.foresight.forecast`` + ``order``) with 50 residents, 50 scheduled agents'
next fires and 64 past uses per model; target p50 <= 5 ms.

Prints a table and a final ``summary:`` line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpulock.core import foresight as fs  # noqa: E402
from gpulock.replay_sim import POLICIES, Arrival, simulate  # noqa: E402

GiB = 1024**3


def cron_6gb(hours: float, rng: random.Random) -> list[Arrival]:
    models = {f"m{i}": int((1.0 + 0.25 * (i % 7)) * GiB) for i in range(8)}
    names = sorted(models)
    out = []
    for a in range(50):
        model = names[a % len(names)]
        period = rng.choice([900, 1800, 3600, 7200])
        t = rng.uniform(0, period)
        hold = rng.uniform(5, 30)
        while t < hours * 3600:
            need = models[model] + GiB // 2
            out.append(Arrival(t, f"agent{a}", model, models[model], hold, need))
            t += period
    return out


def pool_96gb(hours: float, rng: random.Random) -> list[Arrival]:
    models = {f"p{i}": (6 + (i * 5) % 11) * GiB for i in range(12)}
    out = []
    for i, (model, size) in enumerate(sorted(models.items())):
        for k in range(2):  # two agents per model
            period = rng.choice([600, 900, 1800, 2700, 3600])
            t = rng.uniform(0, period)
            while t < hours * 3600:
                hold = rng.uniform(20, 120)
                out.append(Arrival(t, f"agent{i}.{k}", model, size, hold, size + GiB))
                t += period
    t = 5400.0
    while t < hours * 3600:  # the large job: exclusive, its own 40 GiB model
        out.append(Arrival(t, "finetune", "big40", 40 * GiB, 1200.0, None))
        t += 3 * 3600
    return out


def bursty_12gb(hours: float, rng: random.Random) -> list[Arrival]:
    models = {f"b{i}": (2 + i % 4) * GiB for i in range(6)}
    names = sorted(models)
    weights = [6, 4, 3, 2, 1, 1]
    out = []
    t = 0.0
    while t < hours * 3600:
        t += rng.expovariate(1 / 600)  # a burst every 10 minutes on average
        model = rng.choices(names, weights)[0]
        for k in range(rng.randint(1, 8)):  # a few requests for one model, close together
            out.append(
                Arrival(t + 3 * k, "http", model, models[model], rng.uniform(2, 20), models[model])
            )
    return out


WORKLOADS = (
    ("cron-6GB", cron_6gb, 6 * GiB, True),
    ("pool-96GB", pool_96gb, 96 * GiB, True),
    ("bursty-12GB", bursty_12gb, 12 * GiB, False),
)


def decision_ms(rounds: int) -> list[float]:
    """One live decision: forecast + order for 50 residents, 50 planned fires, 64 uses each."""
    rng = random.Random(7)
    now = 1_800_000_000.0
    models = {f"m{i}": rng.randint(1, 16) * GiB for i in range(50)}
    planned = [fs.Planned(f"m{i}", now + rng.uniform(0, 7200), "cron", f"a{i}") for i in range(50)]
    uses = [fs.Use(m, now - rng.uniform(0, 86400)) for m in models for _ in range(64)]
    loads = [fs.Load(m, rng.uniform(1, 30), b) for m, b in models.items()]
    names = sorted(models)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fc = fs.forecast(models, planned, uses, loads, now)
        fs.order(names, model=lambda n: n, today=lambda n: n, forecast=fc)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, default=24.0, help="length of each simulated day")
    p.add_argument("--days", type=int, default=3, help="simulated days per workload (seeds)")
    p.add_argument("--rounds", type=int, default=200, help="decisions timed")
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    checks: list[str] = []
    print(f"{'workload':<12} {'policy':<10} {'arrivals':>8} {'loads':>6} {'GiB reloaded':>13} "
          f"{'wait s':>9} {'run s':>6}")  # fmt: skip
    for name, make, gpu, periodic in WORKLOADS:
        days = [make(args.hours, random.Random(seed)) for seed in range(args.days)]
        n = sum(len(d) for d in days)
        got: dict[str, tuple[int, int, float]] = {}
        for policy in POLICIES:
            t0 = time.perf_counter()
            rs = [simulate(d, gpu, policy) for d in days]
            took = time.perf_counter() - t0
            loads, loaded = sum(r.loads for r in rs), sum(r.loaded_bytes for r in rs)
            wait = sum(r.wait_s_total for r in rs)
            got[policy] = (loads, loaded, wait)
            rows.append({"workload": name, "policy": policy, "days": args.days, "arrivals": n,
                         "loads": loads, "loaded_bytes": loaded, "wait_s_total": wait,
                         "run_s": took})  # fmt: skip
            print(f"{name:<12} {policy:<10} {n:>8} {loads:>6} {loaded / GiB:>13.1f} "
                  f"{wait:>9.0f} {took:>6.2f}")  # fmt: skip
        fo, be, lru = (got[p][1] for p in ("foresight", "belady", "lru"))
        ratio = fo / be if be else 1.0
        saved = 1 - fo / lru if lru else 0.0
        bound = 1 - be / lru if lru else 0.0
        ok = ratio <= 1.2 and (saved >= 0.3 or not periodic)
        kind = " (periodic)" if periodic else ""
        checks.append(
            f"{name}{kind}: foresight {ratio:.2f}x belady, {saved:.0%} less than lru "
            f"(belady: {bound:.0%}) {'ok' if ok else 'MISSED'}"
        )
    ms = decision_ms(args.rounds)
    p50 = statistics.median(ms)
    p99 = sorted(ms)[int(0.99 * (len(ms) - 1))]
    print(f"\ndecision (50 residents, 50 scheduled, 64 uses each): p50 {p50:.2f} ms, "
          f"p99 {p99:.2f} ms")  # fmt: skip
    for c in checks:
        print("  " + c)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "decision_ms": ms}, indent=1))
    ok = all(c.endswith("ok") for c in checks) and p50 <= 5.0
    print(
        "summary: "
        + "; ".join(c.rsplit(" ", 1)[0] for c in checks)
        + f"; decision p50 {p50:.2f} ms -> {'all targets met' if ok else 'targets MISSED'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
