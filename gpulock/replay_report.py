"""What ``gpulock replay`` prints: the table, the HTML page, the notes under them, and the
answer to ``--target-wait`` (the smallest GPU size per policy, and who stands in whose way).

Pure: rows and arrivals in, text and records out; ``gpulock.replay`` does the reading and the
printing.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpulock.core.units import format_size
from gpulock.replay_sim import Arrival, Pair, Row

COLUMNS: Final = ("gpu", "policy", "unfit", "loads", "GiB loaded", "load s", "wait s",
                  "p90 wait s", "misses", "evictions")  # fmt: skip
TOP_PAIRS: Final = 5


@dataclass(frozen=True, slots=True)
class Size:
    """One GPU size to replay, as the user wrote it (``24GiB``, or ``2x24GiB`` for a host of
    two such GPUs), in bytes (each GPU's), and how many GPUs the host has."""

    label: str
    gpu_bytes: int
    count: int = 1

    @property
    def host(self) -> tuple[int, int]:
        """The key of its rows (``Row.host``): (GPUs, each GPU's bytes)."""
        return (self.count, self.gpu_bytes)


def host_label(r: Row) -> str:
    """A row's host as people read it: ``24.0 GiB``, or ``2x24.0 GiB``."""
    size = format_size(r.gpu_bytes)
    return size if r.gpus == 1 else f"{r.gpus}x{size}"


def host_order(r: Row) -> tuple[int, int]:
    """Hosts from the least memory to the most; of equal memory, fewer GPUs first."""
    return (r.gpus * r.gpu_bytes, r.gpus)


def _cell(x: float | int | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: Sequence[Row], arrivals: int) -> str:
    """The rows side by side, then how many arrivals were replayed."""
    cells = [
        (
            host_label(r), r.policy, str(r.unfit), str(r.loads),
            f"{r.loaded_bytes / 1024**3:.1f}", f"{r.load_s:.0f}", _cell(r.wait_s_total, ".0f"),
            _cell(r.wait_s_p90, ".1f"), _cell(r.deadline_misses, "d"), _cell(r.evictions, "d"),
        )
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c[i]) for c in [COLUMNS, *cells]) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [COLUMNS, *cells]
    ]
    lines.append(f"{arrivals} arrivals replayed")
    return "\n".join(lines)


def notes(
    rows: Sequence[Row], arrivals: Sequence[Arrival], load_s_of: Mapping[str, float]
) -> list[str]:
    """What the belady and bound rows are, on this trace; where the bound is missing."""
    out = []
    policies = {r.policy for r in rows}
    if "belady" in policies:
        sizes = {a.model_bytes for a in arrivals if a.model}
        costs = {load_s_of[a.model] for a in arrivals if a.model in load_s_of}
        if len(sizes) > 1 or len(costs) > 1:
            why = f"{len(sizes)} model sizes" if len(sizes) > 1 else "different reload times"
            out.append(
                f"belady: a next-use oracle that ignores sizes and reload cost, not a bound "
                f"here ({why}): foresight may beat it"
            )
        else:
            out.append("belady: the offline optimum here (one model size, one reload cost)")
    if "bound" in policies or any(r.policy == "bound" for r in rows):
        out.append(
            "bound: the fewest reload seconds any policy could reach (cost-aware, offline; it "
            "lets a model in use leave, so it may be out of reach where jobs overlap)"
        )
    return out


def page(rows: Sequence[Row], arrivals: int, extra: Sequence[str] = ()) -> str:
    """A standalone HTML page: the table, then loads and waits by GPU size, a line per policy."""
    waited = [r for r in rows if r.wait_s_total is not None]  # the bound has no waits
    charts = [
        _chart(rows, "model loads", lambda r: float(r.loads)),
        _chart(rows, "GiB loaded", lambda r: r.loaded_bytes / 1024**3),
        _chart(waited, "total wait (s)", lambda r: r.wait_s_total or 0.0),
    ]
    text = "\n".join([table(rows, arrivals), *extra])
    return (
        "<!doctype html><meta charset=utf-8><title>gpulock replay</title>"
        "<style>body{font:14px system-ui;margin:2em}svg{margin:1em 0}</style>"
        f"<h1>gpulock replay</h1><pre>{html.escape(text)}</pre>" + "".join(charts)
    )


COLORS: Final = {
    "lru": "#d62728",
    "keepalive": "#ff7f0e",
    "foresight": "#2ca02c",
    "belady": "#1f77b4",
    "bound": "#7f7f7f",
}


def _chart(rows: Sequence[Row], title: str, value: Callable[[Row], float]) -> str:
    hosts = [r.host for r in sorted(rows, key=host_order)]
    gpus = list(dict.fromkeys(hosts))
    names = {r.host: host_label(r) for r in rows}
    pols = list(dict.fromkeys(r.policy for r in rows))
    top = max((value(r) for r in rows), default=0.0) or 1.0
    w, h, pad = 560, 240, 40

    def xy(g: tuple[int, int], v: float) -> tuple[float, float]:
        x = pad + (w - 2 * pad) * (gpus.index(g) / max(len(gpus) - 1, 1))
        return x, h - pad - (h - 2 * pad) * v / top

    out = [f'<svg width="{w}" height="{h}" role="img"><title>{html.escape(title)}</title>']
    out.append(f'<text x="{pad}" y="16">{html.escape(title)} by GPU size (max {top:.1f})</text>')
    for g in gpus:
        x, _ = xy(g, 0)
        out.append(f'<text x="{x:.0f}" y="{h - 12}" text-anchor="middle">{names[g]}</text>')
    for i, p in enumerate(pols):
        pts = [xy(r.host, value(r)) for r in sorted(rows, key=host_order) if r.policy == p]
        color = COLORS.get(p, "#000")
        d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{d}"/>')
        out.append(f'<text x="{w - pad - 60}" y="{30 + 14 * i}" fill="{color}">{p}</text>')
    out.append("</svg>")
    return "".join(out)


# --- unfit jobs ----------------------------------------------------------------------------


def unfit_lines(size: Size, budget_bytes: int, jobs: Sequence[Arrival]) -> list[str]:
    """Stderr's naming of the jobs that cannot fit ``size``, grouped by name and model."""
    if not jobs:
        return []
    groups: dict[tuple[str, str, int, int | None], int] = {}
    for a in jobs:
        key = (a.name, a.model, a.model_bytes, a.need_bytes)
        groups[key] = groups.get(key, 0) + 1
    reserve = size.gpu_bytes - budget_bytes
    less = (
        f", {format_size(budget_bytes)} after the {format_size(reserve)} reserve" if reserve else ""
    )
    if size.count > 1:
        less += " on each GPU"
    lines = [f"{size.label}{less}: {len(jobs)} job(s) cannot fit, left out of the replay:"]
    for (name, model, model_bytes, need), n in sorted(groups.items(), key=lambda kv: -kv[1]):
        what = f"model {model} {format_size(model_bytes)}" if model else "no model"
        need_text = "exclusive" if need is None else f"need {format_size(need)}"
        lines.append(f"  {name} x{n} ({what}, {need_text})")
    return lines


# --- --target-wait -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Smallest:
    """The smallest size (of those given) at which ``policy``'s p90 wait meets the target with
    every job fitting; None when none does.  ``best``: the row with the lowest p90 otherwise."""

    policy: str
    row: Row | None
    best: Row | None

    def as_dict(self, labels: Mapping[tuple[int, int], str]) -> dict[str, Any]:
        r = self.row
        return {
            "policy": self.policy,
            "gpu": None if r is None else labels.get(r.host, host_label(r)),
            "gpu_bytes": None if r is None else r.gpu_bytes,
            "gpus": None if r is None else r.gpus,
            "wait_s_p90": None if r is None else r.wait_s_p90,
        }


@dataclass(frozen=True, slots=True)
class InTheWay:
    """The pairs of agents that waited on each other most, in one replay (policy and size)."""

    policy: str
    gpu_bytes: int
    why: str  # which size, and why that one
    pairs: tuple[Pair, ...]
    cron: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> crontab lines
    gpus: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "gpu_bytes": self.gpu_bytes,
            "gpus": self.gpus,
            "pairs": [
                {
                    "agents": [p.a, p.b],
                    "times": p.times,
                    "waited_s": round(p.waited_s, 3),
                    "cron": {n: list(self.cron.get(n, ())) for n in (p.a, p.b)},
                }
                for p in self.pairs
            ],
        }


def smallest(rows: Sequence[Row], target_s: float) -> list[Smallest]:
    """Per policy (not the bound, which has no waits): the smallest size meeting the target."""
    out = []
    for policy in dict.fromkeys(r.policy for r in rows if r.wait_s_p90 is not None):
        mine = sorted((r for r in rows if r.policy == policy), key=host_order)
        ok = [r for r in mine if r.unfit == 0 and (r.wait_s_p90 or 0.0) <= target_s]
        fit = [r for r in mine if r.unfit == 0] or mine
        best = min(fit, key=lambda r: (r.wait_s_p90 or 0.0, *host_order(r)), default=None)
        out.append(Smallest(policy, ok[0] if ok else None, best))
    return out


def in_the_way(
    rows: Sequence[Row], target_s: float, answers: Sequence[Smallest]
) -> InTheWay | None:
    """Who stands in whose way, where it matters: foresight's replay (else the first policy's)
    at the largest size that misses the target (moving one agent may make it), else at the
    smallest size given."""
    if not answers:
        return None
    policy = "foresight" if any(a.policy == "foresight" for a in answers) else answers[0].policy
    mine = sorted((r for r in rows if r.policy == policy), key=host_order)
    missed = [r for r in mine if r.unfit or (r.wait_s_p90 or 0.0) > target_s]
    if missed:
        row = missed[-1]
        why = f"{host_label(row)}, the largest size that misses the target"
    else:
        row = mine[0]
        why = f"{host_label(row)}, the smallest size given"
    return InTheWay(policy, row.gpu_bytes, why, row.pairs[:TOP_PAIRS], gpus=row.gpus)


def target_text(
    target_s: float,
    answers: Sequence[Smallest],
    way: InTheWay | None,
    labels: Mapping[tuple[int, int], str],
) -> list[str]:
    """The ``--target-wait`` answer, for people."""
    lines = [f"p90 wait <= {target_s:g} s: the smallest GPU of those given"]
    width = max((len(a.policy) for a in answers), default=0)
    for a in answers:
        if a.row is not None:
            label = labels.get(a.row.host, host_label(a.row))
            lines.append(f"  {a.policy:<{width}}  {label} (p90 {a.row.wait_s_p90 or 0.0:.1f} s)")
        elif a.best is not None:
            b = a.best
            unfit = f", {b.unfit} job(s) cannot fit" if b.unfit else ""
            lines.append(
                f"  {a.policy:<{width}}  none (best: {host_label(b)}, "
                f"p90 {b.wait_s_p90 or 0.0:.1f} s{unfit})"
            )
    if way is None:
        return lines
    if not way.pairs:
        lines.append(f"nobody waited behind another agent ({way.policy} at {way.why})")
        return lines
    lines.append(f"agents that wait on each other most ({way.policy} at {way.why}):")
    for p in way.pairs:
        lines.append(f"  {p.a} <-> {p.b}: {p.times} times, {p.waited_s:.0f} s waited")
        for n in (p.a, p.b):
            for cron in way.cron.get(n, ()):
                lines.append(f"      {n}: {cron}")
    if not way.cron:
        lines.append("  (no crontab line runs them: move one agent's schedule and replay again)")
    return lines
