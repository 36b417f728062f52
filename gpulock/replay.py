"""``gpulock replay``: what another GPU size or eviction policy would have done with a real day.

The arrivals come from the state folder's event log (``--since``, default 24 h) or from a trace
file (``TRACE.csv``); each is replayed by ``gpulock.replay_sim`` for every (GPU size, policy)
asked, and one row per pair is printed: jobs that cannot fit, model loads, GiB loaded,
seconds loading, total and p90 wait, deadline misses, evictions.  The ``bound`` row is the
fewest reload seconds any policy could reach (``gpulock.replay_bound``), where it can be
computed.  A job whose model or ``need`` cannot fit a size (less the config's ``reserve``) is
counted as unfit there, left out, and named on stderr: a replay plans hardware, so it never
replays a job as if it fitted.  ``--target-wait`` asks a question of the rows
(``gpulock.replay_report``): the smallest size per policy whose p90 wait meets it, and the
agents that stand in each other's way.

A trace is CSV with the header ``time_s,name,model,model_bytes,hold_s,need_bytes`` (and the
optional last columns ``deadline_s`` and ``gpus``): seconds from the start, the ticket's name,
the model it uses (empty: none), the model's size in bytes, how long it holds the GPU once its
model is loaded, its ``need`` in bytes (empty: exclusive), the longest it would wait, and how
many GPUs it takes at once (empty: 1).

``--gpu 2x24GiB`` replays on a host of two 24 GiB GPUs: every job asks for its count of GPUs
from all of them (``--gpu any``), decided by the lock's own rule for several GPUs
(``gpulock.replay_sim``).  A malformed line is an error naming the
file, the line and the field; nothing is replayed from a trace that does not parse.

From the event log: each ``acquire``/``release`` pair is an arrival (joined the line at the
grant time less ``waited_s``); its model is the one its agent called (``call`` events with its
name as ``agent``) or loaded (``model-load``) while it held the GPU; sizes from ``model-load``
and ``resident`` events, load times from ``model-load`` (a hold that loaded its model is
replayed without that load: the replay decides whether it loads).
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from gpulock.cli import Parser, UsageError, duration_arg, parse_since, print_json, run_command
from gpulock.core.errors import GpulockError
from gpulock.core.units import parse_size
from gpulock.replay_bound import bound
from gpulock.replay_report import (
    Size,
    in_the_way,
    notes,
    page,
    smallest,
    table,
    target_text,
    unfit_lines,
)
from gpulock.replay_sim import LOAD_BYTES_PER_S, POLICIES, Arrival, Row, fits, simulate, unfit

HEADER: Final = ("time_s", "name", "model", "model_bytes", "hold_s", "need_bytes")
DEFAULT_GPUS: Final = "6GiB,12GiB,24GiB,48GiB,96GiB"
MAX_HOST_GPUS: Final = 64


class TraceError(GpulockError, ValueError):
    """A trace file that does not parse: names the file, the line and the field."""

    def __init__(self, file: str, line: int, field: str | None, problem: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        where = f"{file}:{line}: " + (f"{field}: " if field else "")
        super().__init__(
            where + problem,
            hint="a trace is CSV with the header " + ",".join(HEADER) + " (sizes in bytes)",
        )


# --- reading a trace ---------------------------------------------------------------------------


def read_trace(path: str | Path) -> list[Arrival]:
    """Every arrival of the trace file, or TraceError at the first line that does not parse."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GpulockError(
            f"cannot read trace {file}: {getattr(e, 'strerror', None) or e}"
        ) from None
    return parse_trace(text, file)


def parse_trace(text: str, file: str) -> list[Arrival]:
    rows = list(csv.reader(text.splitlines()))
    if not rows or tuple(c.strip() for c in rows[0][: len(HEADER)]) != HEADER:
        raise TraceError(file, 1, None, "expected the header " + ",".join(HEADER))
    extra = [c.strip() for c in rows[0][len(HEADER) :]]
    if extra not in ([], ["deadline_s"], ["gpus"], ["deadline_s", "gpus"]):
        raise TraceError(
            file, 1, None, f"unknown columns {extra}; known last ones: deadline_s, gpus"
        )
    width = len(HEADER) + len(extra)
    out: list[Arrival] = []
    for n, row in enumerate(rows[1:], 2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != width:
            raise TraceError(file, n, None, f"expected {width} fields, got {len(row)}")
        f = dict(zip((*HEADER, *extra), (c.strip() for c in row), strict=True))
        out.append(
            Arrival(
                time_s=_number(file, n, "time_s", f["time_s"]),
                name=f["name"] or "?",
                model=f["model"],
                model_bytes=_bytes(file, n, "model_bytes", f["model_bytes"], empty=0) or 0,
                hold_s=_number(file, n, "hold_s", f["hold_s"]),
                need_bytes=_bytes(file, n, "need_bytes", f["need_bytes"], empty=None),
                deadline_s=(
                    _number(file, n, "deadline_s", f["deadline_s"])
                    if "deadline_s" in extra and f["deadline_s"]
                    else None
                ),
                gpus=_count(file, n, f["gpus"]) if "gpus" in extra else 1,
            )
        )
    return out


def _count(file: str, line: int, text: str) -> int:
    if not text:
        return 1
    if not text.isdigit() or not 1 <= int(text) <= MAX_HOST_GPUS:
        raise TraceError(file, line, "gpus", f"expected a number of GPUs like 2, got {text!r}")
    return int(text)


def _number(file: str, line: int, field: str, text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise TraceError(file, line, field, f"expected seconds, got {text!r}") from None
    if not math.isfinite(x) or x < 0:
        raise TraceError(file, line, field, f"expected seconds >= 0, got {text!r}")
    return x


def _bytes(file: str, line: int, field: str, text: str, *, empty: int | None) -> int | None:
    if not text:
        return empty
    if not text.isdigit():
        raise TraceError(file, line, field, f"expected a whole number of bytes, got {text!r}")
    return int(text)


# --- reading the event log ---------------------------------------------------------------------


def from_events(events: Iterable[dict[str, Any]]) -> tuple[list[Arrival], dict[str, float]]:
    """The arrivals recorded in ``events`` (oldest first) and each model's median load time."""
    evs = sorted((e for e in events if isinstance(e.get("ts"), int | float)), key=lambda e: e["ts"])
    granted: dict[tuple[Any, Any], dict[str, Any]] = {}
    holds: list[tuple[dict[str, Any], float]] = []  # (acquire event, release time)
    sizes: dict[str, int] = {}
    load_times: dict[str, list[float]] = {}
    for e in evs:
        kind = e.get("event")
        if kind == "acquire":
            granted[(e.get("gpu"), e.get("ticket"))] = e
        elif kind == "release":
            a = granted.pop((e.get("gpu"), e.get("ticket")), None)
            if a is not None:
                holds.append((a, float(e["ts"])))
        elif kind == "model-load" and isinstance(e.get("model"), str):
            if isinstance(e.get("need_bytes"), int):
                sizes[e["model"]] = e["need_bytes"]
            if isinstance(e.get("load_s"), int | float):
                load_times.setdefault(e["model"], []).append(float(e["load_s"]))
        elif (
            kind == "resident"
            and isinstance(e.get("name"), str)
            and isinstance(e.get("declared_bytes"), int)
        ):
            sizes.setdefault(e["name"], e["declared_bytes"])
    uses = [e for e in evs if e.get("event") in ("call", "model-load")]
    out = []
    t0 = min((float(a["ts"]) - _num(a.get("waited_s")) for a, _ in holds), default=0.0)
    for a, end in holds:
        start = float(a["ts"])
        name = str(a.get("name") or "?")
        during = [u for u in uses if start <= u["ts"] <= end]
        mine = [u for u in during if u.get("agent") == name] or [
            u for u in during if u.get("event") == "model-load"
        ]
        model = str(mine[0].get("model") or "") if mine else ""
        loaded = sum(
            _num(u.get("load_s")) for u in during
            if u.get("event") == "model-load" and u.get("model") == model
        )  # fmt: skip
        need = a.get("need_bytes") if isinstance(a.get("need_bytes"), int) else None
        held = a.get("granted")
        out.append(
            Arrival(
                time_s=start - _num(a.get("waited_s")) - t0,
                name=name,
                model=model,
                model_bytes=sizes.get(model, need or 0) if model else 0,
                hold_s=max(end - start - loaded, 0.0),
                need_bytes=need,
                gpus=len(held) if isinstance(held, list) and len(held) > 1 else 1,
            )
        )
    return out, {m: statistics.median(ts) for m, ts in load_times.items()}


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else 0.0


# --- the command -------------------------------------------------------------------------------

ROWS: Final = (*POLICIES, "bound")  # what --policy may name: the simulated policies and the bound


def replay(
    arrivals: Sequence[Arrival],
    gpus: Sequence[int | tuple[int, int]],
    policies: Sequence[str],
    *,
    reserve_of: Callable[[int], int] | None = None,
    load_s_of: dict[str, float] | None = None,
) -> list[Row]:
    """One row per (GPU size, policy), sizes first; ``bound`` rows where it can be computed
    (one GPU).  A size is one GPU's bytes, or (GPUs, each one's bytes) for a host of several."""
    rows = []
    for size in gpus:
        n, g = size if isinstance(size, tuple) else (1, size)
        reserve = reserve_of(g) if reserve_of else 0
        for p in policies:
            if p != "bound":
                rows.append(
                    simulate(arrivals, g, p, gpus=n, reserve_bytes=reserve, load_s_of=load_s_of)
                )
                continue
            if n > 1:
                continue  # the bound is one GPU's (gpulock.replay_bound)
            budget = max(g - reserve, 0)
            ok = [a for a in arrivals if fits(a, budget)]
            b = bound(ok, budget, dict(load_s_of or {}), LOAD_BYTES_PER_S)
            if b is not None:
                rows.append(Row(g, "bound", b.loads, b.loaded_bytes, b.load_s, None, None, None,
                                None, unfit=len(arrivals) - len(ok)))  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def build_parser(prog: str = "gpulock replay") -> Parser:
    p = Parser(
        prog=prog,
        description=(
            "Replay a recorded day or a trace against other GPU sizes and eviction policies.  "
            "The day is the state folder's event log since --since; a trace is a CSV file.  "
            "Prints per (size, policy): jobs that cannot fit the size (less the config's "
            "reserve: left out, named on stderr), loads, GiB loaded, seconds loading, waits, "
            "deadline misses and evictions.  belady is a next-use oracle (it ignores sizes and "
            "reload cost); bound is the fewest reload seconds any policy could reach, where "
            "it can be computed."
        ),
    )
    p.add_argument(
        "trace", nargs="?", metavar="TRACE.csv", help="a trace file (" + ",".join(HEADER) + ")"
    )
    p.add_argument("--since", default="24h", help="from the event log: this far back (default 24h)")
    p.add_argument(
        "--gpu",
        default=DEFAULT_GPUS,
        help=f"GPU sizes (default {DEFAULT_GPUS}); 2x24GiB: a host of two 24 GiB GPUs, where "
        "each job is replayed as --gpu any",
    )
    p.add_argument("--policy", default=",".join(ROWS), help=f"policies (default {','.join(ROWS)})")
    p.add_argument(
        "--target-wait",
        type=duration_arg,
        metavar="DURATION",
        help="also print, per policy, the smallest size whose p90 wait is at most this (60s), "
        "and the agents that wait on each other most, with their crontab lines",
    )
    p.add_argument("--json", action="store_true", help="print a list of rows")
    p.add_argument("--html", metavar="FILE", help="also write a page with charts by GPU size")
    p.add_argument("--config", help="config file (default: the usual search)")
    p.add_argument("--state-dir", help="state folder (default: from the config)")
    return p


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sizes = _sizes(args.gpu)
    policies = _policies(args.policy)
    if args.target_wait is not None and args.target_wait <= 0:
        raise UsageError("--target-wait: a duration above zero", hint="e.g. --target-wait 60s")
    load_s_of: dict[str, float] = {}
    if args.trace is not None:
        from gpulock.core.config import load_config

        arrivals = read_trace(args.trace)
        config = load_config(args.config)
    else:
        from gpulock.core import events
        from gpulock.core.settings import load

        since = parse_since(args.since, time.time())  # a usage mistake before a missing folder
        settings = load(args.config, args.state_dir, create=False)
        arrivals, load_s_of = from_events(events.read(settings.state_dir, since_wall=since))
        config = settings.config
    hosts = [s.host for s in sizes]
    rows = replay(arrivals, hosts, policies, reserve_of=config.reserve_bytes, load_s_of=load_s_of)
    for s in sizes:  # name what cannot fit, on stderr: stdout stays the table (or the JSON)
        budget = max(s.gpu_bytes - config.reserve_bytes(s.gpu_bytes), 0)
        for line in unfit_lines(s, budget, unfit(arrivals, budget, s.count)):
            print(f"gpulock replay: {line}", file=sys.stderr)
    extra = notes(rows, arrivals, load_s_of)
    target: dict[str, Any] | None = None
    if args.target_wait is not None:
        labels = {s.host: s.label for s in sizes}
        answers = smallest(rows, args.target_wait)
        way = in_the_way(rows, args.target_wait, answers)
        if way is not None and way.pairs:
            way = _with_cron(way)
        extra += ["", *target_text(args.target_wait, answers, way, labels)]
        target = {
            "target_wait_s": args.target_wait,
            "smallest_gpu": [a.as_dict(labels) for a in answers],
            "in_each_others_way": None if way is None else way.as_dict(),
        }
    if args.html:
        path = Path(args.html)
        path.write_text(page(rows, len(arrivals), extra), encoding="utf-8")
        print(f"gpulock replay: wrote {path.resolve()}", file=sys.stderr)
    if args.json:
        dicts = [r.as_dict() for r in rows]
        print_json(dicts if target is None else {"rows": dicts, **target})
        return 0
    print("\n".join([table(rows, len(arrivals)), *extra]))
    return 0


def _with_cron(way: Any) -> Any:
    """``way`` with the crontab lines of its agents (an unreadable crontab adds none)."""
    from dataclasses import replace

    from gpulock.residents.foresight_cron import cron_lines

    lines = cron_lines(time.time())
    names = {n for p in way.pairs for n in (p.a, p.b)}
    return replace(way, cron={n: tuple(lines[n]) for n in names if n in lines})


def _sizes(text: str) -> list[Size]:
    """The ``--gpu`` list: one GPU's size each, or ``NxSIZE`` for a host of N such GPUs (kept
    as written, for the answers)."""
    out = []
    for part in text.split(","):
        label = part.strip()
        count_s, times, each = label.partition("x")
        count = 1
        if times and count_s.strip().isdigit():
            count = int(count_s)
            if not 1 <= count <= MAX_HOST_GPUS:
                raise UsageError(
                    f"--gpu: {label!r}: a host of 1 to {MAX_HOST_GPUS} GPUs",
                    hint="e.g. --gpu 2x24GiB",
                )
        else:
            each = label
        try:
            size = parse_size(each.strip())
        except ValueError as e:
            raise UsageError(f"--gpu: {e}", hint="e.g. --gpu 12GiB,24GiB,2x24GiB") from None
        if size <= 0:
            raise UsageError(f"--gpu: a size above zero, got {label!r}")
        out.append(Size(label, size, count))
    return out


def _policies(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in ROWS]
    if bad or not out:
        from gpulock.core.errors import known_hint

        hint = known_hint(bad[0], ROWS, "known") if bad else "known: " + ", ".join(ROWS)
        raise UsageError(
            f"--policy: unknown {', '.join(map(repr, bad)) or 'empty list'}", hint=hint
        )
    return out


if __name__ == "__main__":  # python -m gpulock.replay: before the entry point is installed
    raise SystemExit(main())
