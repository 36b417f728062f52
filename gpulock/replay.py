"""``gpulock replay``: what another GPU size or eviction policy would have done with a real day.

The arrivals come from the state folder's event log (``--since``, default 24 h) or from a trace
file (``TRACE.csv``); each is replayed by ``gpulock.replay_sim`` for every (GPU size, policy)
asked, and one row per pair is printed: model loads, GiB loaded, seconds loading, total and
p90 wait, deadline misses, evictions.

A trace is CSV with the header ``time_s,name,model,model_bytes,hold_s,need_bytes`` (and an
optional last column ``deadline_s``): seconds from the start, the ticket's name, the model it
uses (empty: none), the model's size in bytes, how long it holds the GPU once its model is
loaded, its ``need`` in bytes (empty: exclusive).  A malformed line is an error naming the
file, the line and the field; nothing is replayed from a trace that does not parse.

From the event log: each ``acquire``/``release`` pair is an arrival (joined the line at the
grant time less ``waited_s``); its model is the one its agent called (``call`` events with its
name as ``agent``) or loaded (``model-load``) while it held the GPU; sizes from ``model-load``
and ``resident`` events, load times from ``model-load`` (a hold that loaded its model is
replayed without that load: the replay decides whether it loads).
"""

from __future__ import annotations

import csv
import html
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from gpulock.cli import Parser, UsageError, parse_since, print_json, run_command
from gpulock.core.errors import GpulockError, known_hint
from gpulock.core.units import format_size, parse_size
from gpulock.replay_sim import POLICIES, Arrival, Row, simulate

HEADER: Final = ("time_s", "name", "model", "model_bytes", "hold_s", "need_bytes")
DEFAULT_GPUS: Final = "6GiB,12GiB,24GiB,48GiB,96GiB"


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
    if extra not in ([], ["deadline_s"]):
        raise TraceError(file, 1, None, f"unknown columns {extra}; known last one: deadline_s")
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
                    if extra and f["deadline_s"]
                    else None
                ),
            )
        )
    return out


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
        out.append(
            Arrival(
                time_s=start - _num(a.get("waited_s")) - t0,
                name=name,
                model=model,
                model_bytes=sizes.get(model, need or 0) if model else 0,
                hold_s=max(end - start - loaded, 0.0),
                need_bytes=need,
            )
        )
    return out, {m: statistics.median(ts) for m, ts in load_times.items()}


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else 0.0


# --- the command -------------------------------------------------------------------------------


def replay(
    arrivals: Sequence[Arrival],
    gpus: Sequence[int],
    policies: Sequence[str],
    *,
    reserve_of: Any = None,
    load_s_of: dict[str, float] | None = None,
) -> list[Row]:
    """One row per (GPU size, policy), sizes first."""
    return [
        simulate(
            arrivals, g, p, reserve_bytes=reserve_of(g) if reserve_of else 0, load_s_of=load_s_of
        )
        for g in gpus
        for p in policies
    ]


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def build_parser(prog: str = "gpulock replay") -> Parser:
    p = Parser(
        prog=prog,
        description=(
            "Replay a recorded day or a trace against other GPU sizes and eviction policies.  "
            "The day is the state folder's event log since --since; a trace is a CSV file.  "
            "Prints per (size, policy): loads, GiB loaded, seconds loading, waits, deadline "
            "misses and evictions.  belady is the offline bound."
        ),
    )
    p.add_argument(
        "trace", nargs="?", metavar="TRACE.csv", help="a trace file (" + ",".join(HEADER) + ")"
    )
    p.add_argument("--since", default="24h", help="from the event log: this far back (default 24h)")
    p.add_argument("--gpu", default=DEFAULT_GPUS, help=f"GPU sizes (default {DEFAULT_GPUS})")
    p.add_argument(
        "--policy", default=",".join(POLICIES), help=f"policies (default {','.join(POLICIES)})"
    )
    p.add_argument("--json", action="store_true", help="print a list of rows")
    p.add_argument("--html", metavar="FILE", help="also write a page with charts by GPU size")
    p.add_argument("--config", help="config file (default: the usual search)")
    p.add_argument("--state-dir", help="state folder (default: from the config)")
    return p


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    gpus = _sizes(args.gpu)
    policies = _policies(args.policy)
    load_s_of: dict[str, float] = {}
    reserve_of = None
    if args.trace is not None:
        arrivals = read_trace(args.trace)
    else:
        from gpulock.core import events
        from gpulock.core.settings import load

        since = parse_since(args.since, time.time())  # a usage mistake before a missing folder
        settings = load(args.config, args.state_dir, create=False)
        arrivals, load_s_of = from_events(events.read(settings.state_dir, since_wall=since))
        reserve_of = settings.config.reserve_bytes
    rows = replay(arrivals, gpus, policies, reserve_of=reserve_of, load_s_of=load_s_of)
    if args.html:
        Path(args.html).write_text(page(rows, len(arrivals)), encoding="utf-8")
    if args.json:
        print_json([r.as_dict() for r in rows])
        return 0
    print(table(rows, len(arrivals)))
    return 0


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            size = parse_size(part.strip())
        except ValueError as e:
            raise UsageError(f"--gpu: {e}", hint="e.g. --gpu 12GiB,24GiB") from None
        if size <= 0:
            raise UsageError(f"--gpu: a size above zero, got {part.strip()!r}")
        out.append(size)
    return out


def _policies(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise UsageError(
            f"--policy: unknown {', '.join(map(repr, bad)) or 'empty list'}",
            hint=known_hint(bad[0] if bad else "", POLICIES, "known"),
        )
    return out


COLUMNS: Final = ("gpu", "policy", "loads", "GiB loaded", "load s", "wait s", "p90 wait s",
                  "misses", "evictions")  # fmt: skip


def table(rows: Sequence[Row], arrivals: int) -> str:
    """The rows side by side, and a summary line per GPU size: best policy vs belady."""
    cells = [
        (
            format_size(r.gpu_bytes), r.policy, str(r.loads), f"{r.loaded_bytes / 1024**3:.1f}",
            f"{r.load_s:.0f}", f"{r.wait_s_total:.0f}", f"{r.wait_s_p90:.1f}",
            str(r.deadline_misses), str(r.evictions),
        )
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c[i]) for c in [COLUMNS, *cells]) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [COLUMNS, *cells]
    ]
    lines.append(f"{arrivals} arrivals replayed")
    return "\n".join(lines)


def page(rows: Sequence[Row], arrivals: int) -> str:
    """A standalone HTML page: the table, then loads and waits by GPU size, a line per policy."""
    charts = [
        _chart(rows, "model loads", lambda r: float(r.loads)),
        _chart(rows, "GiB loaded", lambda r: r.loaded_bytes / 1024**3),
        _chart(rows, "total wait (s)", lambda r: r.wait_s_total),
    ]
    return (
        "<!doctype html><meta charset=utf-8><title>gpulock replay</title>"
        "<style>body{font:14px system-ui;margin:2em}svg{margin:1em 0}</style>"
        f"<h1>gpulock replay</h1><pre>{html.escape(table(rows, arrivals))}</pre>" + "".join(charts)
    )


COLORS: Final = {
    "lru": "#d62728",
    "keepalive": "#ff7f0e",
    "foresight": "#2ca02c",
    "belady": "#1f77b4",
}


def _chart(rows: Sequence[Row], title: str, value: Any) -> str:
    gpus = sorted({r.gpu_bytes for r in rows})
    pols = list(dict.fromkeys(r.policy for r in rows))
    top = max((value(r) for r in rows), default=0.0) or 1.0
    w, h, pad = 560, 240, 40

    def xy(g: int, v: float) -> tuple[float, float]:
        x = pad + (w - 2 * pad) * (gpus.index(g) / max(len(gpus) - 1, 1))
        return x, h - pad - (h - 2 * pad) * v / top

    out = [f'<svg width="{w}" height="{h}" role="img"><title>{html.escape(title)}</title>']
    out.append(f'<text x="{pad}" y="16">{html.escape(title)} by GPU size (max {top:.1f})</text>')
    for g in gpus:
        x, _ = xy(g, 0)
        out.append(f'<text x="{x:.0f}" y="{h - 12}" text-anchor="middle">{format_size(g)}</text>')
    for i, p in enumerate(pols):
        pts = [
            xy(r.gpu_bytes, value(r))
            for r in sorted(rows, key=lambda r: r.gpu_bytes)
            if r.policy == p
        ]
        color = COLORS.get(p, "#000")
        d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{d}"/>')
        out.append(f'<text x="{w - pad - 60}" y="{30 + 14 * i}" fill="{color}">{p}</text>')
    out.append("</svg>")
    return "".join(out)


if __name__ == "__main__":  # python -m gpulock.replay: before the entry point is installed
    raise SystemExit(main())
