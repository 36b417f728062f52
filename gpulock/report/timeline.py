"""The timeline SVG: one row per GPU holder and resident model, governor levels behind them.

Holds, waits and residencies are bars, markers are symbols; in a huge log, bars of one row
less than a few pixels apart merge into one (``_Merger``), and so do markers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gpulock.core.units import format_duration, format_size
from gpulock.report.model import Hold, Marker, ReportData, Residency, Row, Wait
from gpulock.report.svg import LEFT, Scale, W, axis, esc, px
from gpulock.report.values import clock

LEVELS = (
    "normal",
    "reduce",
    "evict-idle",
    "force-evict",
    "freeze",
)  # as gpulock.governor.model has them
ROW_H, BAR_H, AXIS_H = 20, 12, 24
MERGE_ABOVE = 4000  # more bars than this in the timeline: bars close together merge
MERGE_GAP_PX = 3.0  # ...when less than this apart (about a minute in a 12-hour report)
PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#8cd17d", "#499894", "#d37295",
)  # fmt: skip
LEVEL_CLASS = {lv: f"lv-{lv}" for lv in LEVELS}  # a class name never comes from the log


def _rows(data: ReportData) -> list[Row]:
    """Timeline rows in order: per GPU its holders, then its models; the governor last."""
    seen: dict[Row, None] = {}
    items: list[tuple[float, str, int | None, str]] = [
        *((h.start_wall, "holder", h.gpu, h.name) for h in data.holds),
        *((w.start_wall, "holder", w.gpu, w.name) for w in data.waits),
        *((r.start_wall, "resident", r.gpu, r.name) for r in data.residencies),
        *((m.at_wall, m.lane, m.gpu, m.name) for m in data.markers if m.lane != "governor"),
    ]
    for _, lane, gpu, name in sorted(items, key=lambda x: x[0]):
        seen.setdefault((lane, gpu, name), None)
    lane_rank = {"holder": 0, "resident": 1}
    rows = sorted(seen, key=lambda r: (r[1] is None, r[1] or 0, lane_rank.get(r[0], 2)))
    if any(m.lane == "governor" for m in data.markers) or any(
        lv.level != "normal" for lv in data.levels
    ):
        rows.append(("governor", None, "governor"))
    return rows


def _mark_path(kind: str, x: float, y: float) -> str:
    r = 5.0
    if kind == "timeout" or kind == "governor-error":
        a, b, c, d = px(x - r), px(x + r), px(y - r), px(y + r)
        return f"M{a} {c}L{b} {d}M{a} {d}L{b} {c}"
    if kind in ("evict", "deescalate", "kill"):
        return f"M{px(x - r)} {px(y - r)}L{px(x + r)} {px(y - r)}L{px(x)} {px(y + r)}Z"
    if kind == "escalate":
        return f"M{px(x - r)} {px(y + r)}L{px(x + r)} {px(y + r)}L{px(x)} {px(y - r)}Z"
    return f"M{px(x)} {px(y - r)}L{px(x + r)} {px(y)}L{px(x)} {px(y + r)}L{px(x - r)} {px(y)}Z"


def _hold_title(h: Hold) -> str:
    where = f"gpu{h.gpu}" if h.gpu is not None else "gpu ?"
    ticket = f" ticket {h.ticket}" if h.ticket is not None else ""
    need = f", need {format_size(h.need_bytes)}" if h.need_bytes else ", exclusive"
    end = {
        "release": "released",
        "open": "no release in the log",
        "cleanup": "cleaned up",
        "break": "broken",
    }.get(h.end, h.end)
    why = f" ({h.why})" if h.why and h.cut_short else ""
    killed = ", killed" if h.killed else ""
    return (
        f"{h.name} · {where}{ticket}{need} · {clock(h.start_wall, '%H:%M:%S')} for "
        f"{format_duration(h.end_wall - h.start_wall)} · {end}{killed}{why}"
    )


def _background(
    data: ReportData, scale: Scale, rows: list[Row], y_of: list[int], height: int
) -> list[str]:
    """Stripes, governor level bands, the time grid and the row labels."""
    out = []
    for i in range(1, len(rows), 2):
        out.append(f'<rect class="stripe" x="0" y="{y_of[i]}" width="{W}" height="{ROW_H}"/>')
    for lv in data.levels:
        if lv.level == "normal":
            continue
        x0, x1 = scale.x(lv.start_wall), scale.x(lv.end_wall)
        cls = LEVEL_CLASS.get(lv.level, "lv-other")
        out.append(
            f'<rect class="level {cls}" x="{px(x0)}" y="{AXIS_H}" width="{px(max(x1 - x0, 1))}" '
            f'height="{height - AXIS_H}"><title>governor level {esc(lv.level)} from '
            f"{esc(clock(lv.start_wall))} for {esc(format_duration(lv.end_wall - lv.start_wall))}"
            "</title></rect>"
        )
    out += axis(scale, AXIS_H - 4, height, 14)
    last_gpu: object = object()
    for i, (lane, gpu, name) in enumerate(rows):
        y = y_of[i]
        if gpu != last_gpu and lane != "governor":
            out.append(f'<line class="gpu-sep" x1="0" x2="{W}" y1="{y}" y2="{y}"/>')
        last_gpu = gpu
        where = "" if lane == "governor" else (f"gpu{gpu} " if gpu is not None else "gpu? ")
        icon = "model " if lane == "resident" else ""
        out.append(
            f'<text class="row-label {lane}" x="{LEFT - 8}" y="{y + ROW_H / 2 + 4:.0f}" '
            f'text-anchor="end">{esc(where)}{icon}{esc(name)}</text>'
        )
    return out


def timeline(data: ReportData, scale: Scale) -> str:
    rows = _rows(data)
    if not rows:
        return '<p class="none">nothing was held, waited for or loaded in this window</p>'
    index = {r: i for i, r in enumerate(rows)}
    y_of = [AXIS_H + i * ROW_H for i in range(len(rows))]
    height = AXIS_H + len(rows) * ROW_H + 6
    out = [
        f'<svg class="timeline" viewBox="0 0 {W} {height}" width="100%" role="img" '
        f'aria-label="timeline of GPU holders">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="3" height="6" fill="#fff" '
        'fill-opacity=".55"/></pattern></defs>',
    ]
    out += _background(data, scale, rows, y_of, height)
    color = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(rows)}
    merge = len(data.holds) + len(data.waits) + len(data.residencies) > MERGE_ABOVE
    bars = _Merger()  # drawn singly (in bars.out) unless merge
    for w in data.waits:
        r = ("holder", w.gpu, w.name)
        if merge:
            x0, x1 = scale.x(w.start_wall), scale.x(w.end_wall)
            bars.add(r, x0, x1, y_of[index[r]], color[r], "wait")
        else:
            bars.out.append(_wait_rect(w, scale, y_of[index[r]], color[r]))
    for h in data.holds:
        r = ("holder", h.gpu, h.name)
        if merge and not h.cut_short:  # cut-short holds are rare and always drawn alone
            bars.add(
                r, scale.x(h.start_wall), scale.x(h.end_wall), y_of[index[r]], color[r], "hold"
            )
        else:
            bars.out.append(_hold_rect(h, scale, y_of[index[r]], color[r]))
    for res in data.residencies:
        r = ("resident", res.gpu, res.name)
        if merge:
            x0, x1 = scale.x(res.start_wall), scale.x(res.end_wall)
            bars.add(r, x0, x1, y_of[index[r]], "", "resident")
        else:
            bars.out.append(_resident_rect(res, scale, y_of[index[r]]))
    out += bars.finish()
    out += _marks(data, scale, index, y_of)
    out.append("</svg>")
    return "".join(out)


_MARK_CLASSES = frozenset(
    {"timeout", "kill", "break", "cleanup", "stale", "evict", "oom", "escalate", "deescalate",
     "governor-error", "unload"}
)  # fmt: skip
_BAR_GEOMETRY = {"hold": (4, BAR_H), "wait": (5, BAR_H - 2), "resident": (6, BAR_H - 4)}


class _Merger:
    """With a huge log, bars of one row and kind less than a pixel apart become one rect."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.pending: dict[tuple[Row, str], list[Any]] = {}  # -> [x0, x1, n, y, fill]

    def add(self, row: Row, x0: float, x1: float, y: int, fill: str, cls: str) -> None:
        p = self.pending.get((row, cls))
        if p is not None and x0 - p[1] < MERGE_GAP_PX:
            p[1], p[2] = max(p[1], x1), p[2] + 1
            return
        if p is not None:
            self._flush((row, cls))
        self.pending[(row, cls)] = [x0, x1, 1, y, fill]

    def _flush(self, key: tuple[Row, str]) -> None:
        (_, _, name), cls = key
        x0, x1, n, y, fill = self.pending.pop(key)
        dy, h = _BAR_GEOMETRY[cls]
        paint = f' fill="{fill}"' if fill else ""
        self.out.append(
            f'<rect class="{cls} merged" data-n="{n}" x="{px(x0)}" y="{y + dy}" '
            f'width="{px(max(x1 - x0, 1))}" height="{h}"{paint}>'
            f"<title>{esc(name)}: {n} {cls} bars</title></rect>"
        )

    def finish(self) -> list[str]:
        for key in list(self.pending):
            self._flush(key)
        return self.out


def _wait_rect(w: Wait, scale: Scale, y: int, fill: str) -> str:
    x0, x1 = scale.x(w.start_wall), scale.x(w.end_wall)
    return (
        f'<rect class="wait" x="{px(x0)}" y="{y + 5}" width="{px(max(x1 - x0, 1))}" '
        f'height="{BAR_H - 2}" fill="{fill}"><title>{esc(w.name)} waited '
        f"{esc(format_duration(w.end_wall - w.start_wall))} → {esc(w.end)}</title></rect>"
    )


def _hold_rect(h: Hold, scale: Scale, y: int, fill: str) -> str:
    x0, x1 = scale.x(h.start_wall), scale.x(h.end_wall)
    width = px(max(x1 - x0, 2))
    ticket = "" if h.ticket is None else f' data-ticket="{h.ticket}"'
    text = (
        f'<rect class="hold{" cut" if h.cut_short else ""}" data-gpu="{esc(h.gpu)}"{ticket} '
        f'x="{px(x0)}" y="{y + 4}" width="{width}" height="{BAR_H}" fill="{fill}">'
        f"<title>{esc(_hold_title(h))}</title></rect>"
    )
    if h.cut_short:  # the hatch and a red end say "this hold did not end by a release"
        text += (
            f'<rect class="cut-hatch" x="{px(x0)}" y="{y + 4}" width="{width}" '
            f'height="{BAR_H}" fill="url(#hatch)"/><line class="cut-end" x1="{px(x1)}" '
            f'x2="{px(x1)}" y1="{y + 1}" y2="{y + ROW_H - 1}"/>'
        )
    return text


def _resident_rect(res: Residency, scale: Scale, y: int) -> str:
    x0, x1 = scale.x(res.start_wall), scale.x(res.end_wall)
    size = format_size(res.declared_bytes) if res.declared_bytes else "size unknown"
    return (
        f'<rect class="resident" x="{px(x0)}" y="{y + 6}" width="{px(max(x1 - x0, 1))}" '
        f'height="{BAR_H - 4}"><title>model {esc(res.name)} ({esc(res.resident)}), {size}, '
        f"resident {esc(format_duration(res.end_wall - res.start_wall))} → "
        f"{esc(res.end)}</title></rect>"
    )


def _marks(data: ReportData, scale: Scale, index: dict[Row, int], y_of: list[int]) -> list[str]:
    """One symbol per marker; in a huge log, one per row, kind and 6 pixels, with a count."""
    groups: dict[tuple[Row, str, int], list[Marker]] = defaultdict(list)
    merge = len(data.markers) > MERGE_ABOVE
    for i, m in enumerate(data.markers):
        r = ("governor", None, "governor") if m.lane == "governor" else (m.lane, m.gpu, m.name)
        if r in index:
            groups[(r, m.kind, int(scale.x(m.at_wall) / 6) if merge else i)].append(m)
    out = []
    for (r, kind, _), ms in groups.items():
        m = ms[0]
        y = y_of[index[r]] + ROW_H / 2
        cls = kind if kind in _MARK_CLASSES else "other"
        if len(ms) == 1:
            title = f"{m.kind} · {m.name} · {clock(m.at_wall, '%H:%M:%S')}"
            title += f" · {m.text}" if m.text else ""
        else:
            title = f"{len(ms)} x {m.kind} · {m.name} · from {clock(m.at_wall, '%H:%M:%S')}"
        out.append(
            f'<path class="mark {cls}" d="{_mark_path(kind, scale.x(m.at_wall), y)}">'
            f"<title>{esc(title)}</title></path>"
        )
    return out


# The timeline's key in words and symbols; the page draws it above the timeline.
LEGEND = (
    '<div class="legend">'
    '<span><svg width="26" height="12"><rect width="26" height="12" fill="#4e79a7"/></svg>'
    "hold (acquire → release)</span>"
    '<span><svg width="26" height="12"><rect width="26" height="12" fill="#4e79a7" '
    'fill-opacity=".25"/></svg>waiting in line</span>'
    '<span><svg width="26" height="12"><rect width="26" height="12" fill="#4e79a7"/>'
    '<rect width="26" height="12" fill="url(#hatch)"/><line x1="25" x2="25" y1="0" y2="12" '
    'stroke="#c0392b" stroke-width="2"/></svg>cut short (no release: cleaned up, broken, '
    "killed, or still open at the end of the log)</span>"
    '<span><svg width="26" height="12"><rect width="26" height="8" y="2" fill="#b07aa1" '
    'fill-opacity=".6"/></svg>resident model</span>'
    '<span><svg width="12" height="12"><path class="mark timeout" d="M1 1L11 11M1 11L11 1"/>'
    "</svg>timeout</span>"
    '<span><svg width="12" height="12"><path class="mark evict" d="M1 1L11 1L6 11Z"/></svg>'
    "eviction / kill</span>"
    '<span><svg width="12" height="12"><path class="mark cleanup" d="M6 1L11 6L6 11L1 6Z"/>'
    "</svg>cleanup / break / stale</span>"
    '<span><svg width="26" height="12"><rect class="level lv-reduce" width="26" height="12"/>'
    '</svg>governor level above normal (reduce, evict-idle, force-evict, <span class="fz">'
    "freeze</span>)</span></div>"
)
