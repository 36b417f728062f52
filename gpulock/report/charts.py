"""The per-GPU charts: waiters in line, VRAM claimed, VRAM used as the governor measured it.

Step lines (or samples) on the timeline's time axis; beyond a few points per pixel column a
series is drawn from each column's first, highest, lowest and last point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gpulock.core.units import format_size
from gpulock.report.model import Point, ReportData
from gpulock.report.svg import LEFT, PW, RIGHT, Scale, W, axis, esc, px

CHART_H = 150


def _nice(v: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above ``v`` (> 0)."""
    if v <= 0:
        return 1.0
    p = 10.0 ** math.floor(math.log10(v))
    return next(m * p for m in (1, 2, 2.5, 5, 10) if m * p >= v * (1 - 1e-9))


def _downsample(points: Sequence[Point], scale: Scale) -> list[Point]:
    """Steps as drawn: beyond ~4 per pixel column, keep each column's first, max, min, last."""
    if len(points) <= 4 * PW:
        return list(points)
    out: list[Point] = []
    col: list[Point] = []
    key = None
    for p in points:
        k = int(scale.x(p[0]))
        if k != key and col:
            out += _column(col)
            col = []
        key = k
        col.append(p)
    out += _column(col)
    return out


def _column(col: list[Point]) -> list[Point]:
    if len(col) <= 4:
        return col
    t = col[0][0]
    hi = max(col, key=lambda p: p[1])
    lo = min(col, key=lambda p: p[1])
    return [col[0], (t, hi[1]), (t, lo[1]), (t, col[-1][1])]


def _chart(
    scale: Scale,
    series: Sequence[tuple[str, str, Sequence[Point]]],
    y_max: float,
    y_label: Any,
    *,
    bands: Sequence[tuple[float, float]] = (),
    samples: bool = False,
    cls: str = "",
) -> str:
    """A step (or sample) line chart on the shared time axis, y from 0 to ``y_max``."""
    top, bottom = 10, CHART_H - 24

    def y(v: float) -> float:
        return bottom - (bottom - top) * min(max(v / y_max, 0.0), 1.05)

    out = [f'<svg class="chart {cls}" viewBox="0 0 {W} {CHART_H}" width="100%" role="img">']
    for s, t in bands:
        x0, x1 = scale.x(s), scale.x(t)
        out.append(
            f'<rect class="band" x="{px(x0)}" y="{top}" width="{px(max(x1 - x0, 1))}" '
            f'height="{bottom - top}"><title>exclusive hold: the whole GPU</title></rect>'
        )
    out += axis(scale, top, bottom, CHART_H - 8)
    for frac in (0.0, 0.5, 1.0):
        yy = px(y(y_max * frac))
        out.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{yy}" y2="{yy}"/>')
        out.append(
            f'<text class="tick" x="{LEFT - 8}" y="{px(y(y_max * frac) + 4)}" '
            f'text-anchor="end">{esc(y_label(y_max * frac))}</text>'
        )
    for i, (name, color, points) in enumerate(series):
        if not points:
            continue
        pts = _downsample(points, scale)
        if samples:
            d = "M" + "L".join(f"{px(scale.x(t))} {px(y(v))}" for t, v in pts)
            dots = "".join(
                f'<circle cx="{px(scale.x(t))}" cy="{px(y(v))}" r="2.5" fill="{color}"/>'
                for t, v in pts[:2000]
            )
        else:
            parts = [f"M{px(scale.x(pts[0][0]))} {px(y(pts[0][1]))}"]
            for t, v in pts[1:]:
                parts.append(f"H{px(scale.x(t))}V{px(y(v))}")
            parts.append(f"H{px(scale.x(scale.t1))}")
            d, dots = "".join(parts), ""
        out.append(
            f'<path class="series s{i}" d="{d}" stroke="{color}"><title>{esc(name)}</title></path>'
            f"{dots}"
        )
    out.append("</svg>")
    return "".join(out)


def _key(series: Sequence[tuple[str, str, Sequence[Point]]], band: str = "") -> str:
    """The line colours of a chart, in words."""
    items = [
        f'<span><svg width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" stroke="{c}" '
        f'stroke-width="2.5"/></svg>{esc(name)}</span>'
        for name, c, _ in series
    ]
    if band:
        items.append(
            '<span><svg width="22" height="10"><rect width="22" height="10" class="band"/></svg>'
            f"{esc(band)}</span>"
        )
    return '<div class="legend">' + "".join(items) + "</div>"


def _size_max(v: float) -> tuple[float, Any]:
    unit = 1024**3 if v >= 1024**3 else 1024**2
    return _nice(v / unit) * unit, lambda b: format_size(round(b)) if b else "0"


def gpu_charts(data: ReportData, scale: Scale) -> tuple[str, str]:
    queue, vram = [], []
    for s in data.series:
        q_max = max((v for _, v in s.queue), default=0.0)
        ym = max(1.0, float(math.ceil(q_max)))
        if ym > 4:
            ym = _nice(ym)
            ym += ym % 2  # an even top: the middle tick is a whole number of waiters
        queue.append(
            f"<h3>gpu{s.gpu}: waiters in line (peak {q_max:.0f})</h3>"
            + _chart(scale, [("waiters", "#e15759", s.queue)], ym, lambda v: f"{v:g}", cls="queue")
        )
        b_max = max([v for _, v in s.held_bytes] + [v for _, v in s.resident_bytes] + [0.0])
        if b_max > 0 or s.exclusive:
            top, fmt = _size_max(b_max or 1024**3)
            series = [
                ("held by lock holders (their --need)", "#4e79a7", s.held_bytes),
                ("resident models (declared)", "#b07aa1", s.resident_bytes),
            ]
            band = "exclusive hold (no --need: the whole GPU)" if s.exclusive else ""
            vram.append(
                f"<h3>gpu{s.gpu}: VRAM claimed (peak {esc(format_size(round(b_max)))})</h3>"
                + _key(series, band)
                + _chart(scale, series, top, fmt, bands=s.exclusive, cls="vram")
            )
        if s.used_fraction:
            used = [("used share of the GPU's memory", "#e15759", s.used_fraction)]
            vram.append(
                f"<h3>gpu{s.gpu}: VRAM used, as the governor measured it</h3>"
                + _key(used)
                + _chart(
                    scale,
                    used,
                    1.0,
                    lambda v: f"{v * 100:.0f}%",
                    samples=True,
                    cls="vram-used",
                )
            )
    if not vram:
        vram.append('<p class="none">no VRAM data in this log</p>')
    if not queue:
        queue.append('<p class="none">no GPU queue events in this log</p>')
    return "".join(queue), "".join(vram)
