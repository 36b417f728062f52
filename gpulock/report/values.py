"""Values in and out of the report: the log's fields read defensively, times written as text.

The event log is user-controlled: a field of the wrong type, an infinite number or a novel-long
name reads as "not there" (None) or is cut, never raises.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

SPAN_MAX_S = 1e8  # three years: a longer wait or hold is garbage
NAME_MAX = 120  # longer names from the log are cut: a label is not a place for a novel


def as_num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:  # JSON integers have no limit
        return None
    return f if math.isfinite(f) else None


def as_int(v: Any) -> int | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    return v if ok else None


def as_span(v: Any) -> float | None:
    """A duration field: None unless a plausible number of seconds."""
    f = as_num(v)
    return f if f is not None and 0 <= f <= SPAN_MAX_S else None


def as_text(v: Any, default: str = "") -> str:
    if v is None:
        return default
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= NAME_MAX else s[: NAME_MAX - 1] + "…"


def clock(wall: float | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """``wall`` as local clock time; "?" for None, the bare number where the platform cannot."""
    if wall is None:
        return "?"
    try:
        return time.strftime(fmt, time.localtime(wall))
    except (OverflowError, OSError, ValueError):
        return f"{wall:.0f}"
