"""An agent batch's checkpoint: the journal vs rewriting every done key, vs sqlite3.

Run: ``.venv/bin/python bench/checkpoint.py [--items N] [--old-max N] [--json FILE]`` (~1 min)

A ``for item in ctx.batch(items)`` loop whose body does nothing, so the checkpoint is all that
is measured, over ``--items`` (100,000) items with keys like ``notes/2026-11-23-00042.txt``:

- old: ``gpulock/agents/checkpoint.py`` before this change (the whole ``done`` list rewritten
  atomically after every item, copied here).  Quadratic: it is run up to ``--old-max``
  (10,000) items and its time at 100,000 projected through its two largest sizes
  (``a n + b n^2``: a fixed cost per write plus the growing list);
- new: ``gpulock.agents.checkpoint.checkpointed`` (a snapshot once, one journal line per item);
- sqlite3: what a user might write instead: a table of done keys, one INSERT and one COMMIT
  per item (WAL, ``synchronous=NORMAL``), the same durability against a killed process.

Per size: total time, per item, bytes written to the state folder.  Then the cost of resuming
(reading the checkpoint of a run killed at 50 %).  Prints tables and a ``summary:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpulock.agents import checkpoint  # noqa: E402
from gpulock.core.statefile import atomic_write  # noqa: E402


class Written:
    bytes = 0


@dataclass(frozen=True, slots=True)
class Row:
    impl: str
    items: int
    s: float
    bytes: int


def old_batch(keys: list[str], path: Path) -> None:
    """The loop before this change: encode + atomic_write of every done key, per item."""
    done: list[str] = []
    for key in keys:
        done.append(key)
        data = checkpoint.encode("bench", done, len(keys))
        atomic_write(path, data)
        Written.bytes += len(data)
    os.unlink(path)


def new_batch(keys: list[str], path: Path) -> None:
    for _item in checkpoint.checkpointed(
        keys, keys, set(), path=path, agent="bench", mode=0o600, finished=_nop, ended=_nop
    ):
        pass
    Written.bytes += sum(len(json.dumps(k)) + 1 for k in keys) + len(
        checkpoint.encode("bench", [], len(keys))
    )


def sqlite_batch(keys: list[str], path: Path) -> None:
    db = sqlite3.connect(path.with_suffix(".db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS done (key TEXT PRIMARY KEY)")
    for key in keys:
        db.execute("BEGIN")
        db.execute("INSERT OR IGNORE INTO done VALUES (?)", (key,))
        db.execute("COMMIT")
    db.close()
    for suffix in (".db", ".db-wal", ".db-shm"):
        p = path.with_suffix(suffix)
        if p.exists():
            Written.bytes += p.stat().st_size
            p.unlink()


def _nop(*_a: object) -> None:
    pass


def timed(
    fn: Callable[[list[str], Path], None], keys: list[str], folder: Path
) -> tuple[float, int]:
    Written.bytes = 0
    t0 = time.perf_counter()
    fn(keys, folder / "checkpoint.json")
    return time.perf_counter() - t0, Written.bytes


def resume_ms(keys: list[str], folder: Path) -> float:
    """A run killed at 50 %: what reading its checkpoint back costs."""
    path = folder / "checkpoint.json"
    it = checkpoint.checkpointed(
        keys, keys, set(), path=path, agent="bench", mode=0o600, finished=_nop, ended=_nop
    )
    for i, _item in enumerate(it):
        if i == len(keys) // 2:
            break
    it.close()
    t0 = time.perf_counter()
    found = checkpoint.resumed(path, keys)
    ms = (time.perf_counter() - t0) * 1000
    assert len(found) == len(keys) // 2, len(found)
    checkpoint.remove(path)
    return ms


def project(two: list[Row], n: int, of: Callable[[Row], float]) -> float:
    """``a n + b n^2`` through two measured sizes (a fixed cost per write plus the list)."""
    (n1, y1), (n2, y2) = ((r.items, of(r)) for r in two)
    b = (y2 / n2 - y1 / n1) / (n2 - n1)
    a = y1 / n1 - b * n1
    return a * n + b * n * n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--old-max", type=int, default=10_000)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    n = args.items
    sizes = sorted({s for s in (1_000, args.old_max // 2, args.old_max, n) if 0 < s <= n})
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpulock-bench-ckpt-") as tmp:
        folder = Path(tmp)
        for size in sizes:
            keys = [f"notes/2026-11-23-{i:05d}.txt" for i in range(size)]
            for label, fn in (("old", old_batch), ("new", new_batch), ("sqlite3", sqlite_batch)):
                if label == "old" and size > args.old_max:
                    continue
                secs, written = timed(fn, keys, folder)
                rows.append(Row(label, size, secs, written))
        keys = [f"notes/2026-11-23-{i:05d}.txt" for i in range(n)]
        resume = resume_ms(keys, folder)

    def row(impl: str, size: int) -> Row:
        return next(r for r in rows if r.impl == impl and r.items == size)

    olds = sorted((r for r in rows if r.impl == "old"), key=lambda r: r.items)
    last_old = olds[-1]
    projected_s = project(olds[-2:], n, lambda r: r.s)
    projected_b = project(olds[-2:], n, lambda r: float(r.bytes))
    print(
        f"checkpoint benchmark: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.2f}; keys like notes/2026-11-23-00042.txt; empty loop body"
    )
    print(f"  {'items':>8}  {'checkpoint':<10}{'total':>10}{'per item':>11}{'written':>13}")
    for r in rows:
        print(
            f"  {r.items:>8,}  {r.impl:<10}{r.s:>9.2f}s{r.s / r.items * 1e6:>9.1f}us"
            f"{r.bytes / 2**20:>9.1f} MiB"
        )
    print(
        f"  {n:>8,}  {'old':<10}{projected_s:>9.0f}s{projected_s / n * 1e6:>9.1f}us"
        f"{projected_b / 2**30:>9.1f} GiB  (projected: a n + b n^2 through "
        f"{olds[-2].items:,} and {last_old.items:,})"
    )
    print(f"  resuming a run killed at 50 % of {n:,}: reading the checkpoint {resume:.1f} ms")
    new, lite = row("new", n), row("sqlite3", n)
    print(
        f"\nsummary: {n:,} items checkpointed in {new.s:.2f} s new "
        f"({new.s / n * 1e6:.1f} us an item), sqlite3 {lite.s:.2f} s, "
        f"old ~{projected_s:.0f} s projected ({last_old.s:.1f} s at {last_old.items:,}); "
        f"written {new.bytes / 2**20:.1f} MiB vs ~{projected_b / 2**30:.0f} GiB old; "
        f"resume {resume:.0f} ms"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": [asdict(r) for r in rows], "projected_old_s": projected_s})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
