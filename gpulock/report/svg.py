"""What every SVG of the page shares: the time scale and its axis, compact coordinates, escaping.

Every chart uses the same ``Scale`` (and width), so the timeline and the charts line up.
"""

from __future__ import annotations

import html
import math
import time

from gpulock.report.values import clock

W, LEFT, RIGHT = 1200, 210, 24  # the SVGs' coordinate width, label column, right margin
PW = W - LEFT - RIGHT
_STEPS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
    600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800,
)  # fmt: skip


def esc(value: object) -> str:
    """HTML-escaped text, quotes included: log strings land in attributes and titles too."""
    return html.escape(str(value), quote=True)


class Scale:
    """Wall time to x in the SVGs' coordinates; every chart shares it, so they line up."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.t1 = t1 if t1 - t0 >= 1e-3 else t0 + 1.0  # one event: a 1 s window, not 0
        self.k = PW / (self.t1 - self.t0)

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) * self.k

    def ticks(self, want: int = 8) -> tuple[list[float], float]:
        span = self.t1 - self.t0
        step = next((s for s in _STEPS_S if span / s <= want), _STEPS_S[-1])
        off = _utc_offset(self.t0)  # align ticks to the local clock
        t = math.ceil((self.t0 + off) / step) * step - off
        out: list[float] = []
        while t <= self.t1 + 1e-9 and len(out) < 4 * want:
            out.append(t)
            t += step
        return out, step

    def label(self, t: float, step: float) -> str:
        if step >= 86400:
            return clock(t, "%m-%d")
        if step >= 60:
            return clock(t, "%H:%M")
        text = clock(t, "%H:%M:%S")
        if step < 1:
            digits = 1 if step >= 0.1 else 2 if step >= 0.01 else 3
            text += f"{t % 1:.{digits}f}"[1:]
        return text


def _utc_offset(wall: float) -> int:
    try:
        return time.localtime(wall).tm_gmtoff
    except (OverflowError, OSError, ValueError):
        return 0


def px(v: float) -> str:
    """A coordinate: one decimal, no trailing zero (compact SVG)."""
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def axis(scale: Scale, top: float, bottom: float, labels_at: float) -> list[str]:
    ticks, step = scale.ticks()
    out = []
    for t in ticks:
        x = px(scale.x(t))
        out.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{px(top)}" y2="{px(bottom)}"/>')
        out.append(
            f'<text class="tick" x="{x}" y="{px(labels_at)}" text-anchor="middle">'
            f"{esc(scale.label(t, step))}</text>"
        )
    return out
