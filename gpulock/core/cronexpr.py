"""Crontab schedules read as cron reads them, and their next fire time: pure, stdlib only.

Foresight reads the system crontab (``crontab -l``, ``/etc/cron.d``) to learn when the agents
it serves run next.  The fleet's own schedules are APScheduler's business (``agents``); this is
the small part gpulock needs without importing the packages built on it: five fields (minute
hour day month weekday) with ``*``, ``a-b``, ``*/n``, ``a-b/n``, lists, month and day names, and
the ``@daily`` family.  Cron's rule holds: when both day-of-month and day-of-week are
restricted, either one matching is enough (a field starting with ``*``, ``*/2`` too, is not
restricted: cron's and ``gpulock.agents.schedules``' reading).  Times are local
(``time.localtime``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

ALIASES: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTH_NAMES: Final = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov")
_MONTHS: Final = {m: i + 1 for i, m in enumerate((*_MONTH_NAMES, "dec"))}
_DAYS: Final = {d: i for i, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
_RANGES: Final[tuple[tuple[int, int, dict[str, int]], ...]] = (
    (0, 59, {}),
    (0, 23, {}),
    (1, 31, {}),
    (1, 12, _MONTHS),
    (0, 7, _DAYS),
)
HORIZON_DAYS: Final = 366  # Feb 29 and friends: no fire within a year is "never"


@dataclass(frozen=True, slots=True)
class Cron:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day-of-month starts with '*' ('*', '*/2')
    any_weekday: bool

    def day_matches(self, mday: int, month: int, wday_sun0: int) -> bool:
        if month not in self.months:
            return False
        in_days = mday in self.days
        in_week = wday_sun0 in self.weekdays
        if self.any_day or self.any_weekday:
            return in_days and in_week
        return in_days or in_week

    def next_fire(self, after_wall: float) -> float | None:
        """The first fire strictly after ``after_wall`` (local time), None within a year."""
        t = (int(after_wall) // 60 + 1) * 60
        lt = time.localtime(t)
        y, mo, d = lt.tm_year, lt.tm_mon, lt.tm_mday
        first_h, first_m = lt.tm_hour, lt.tm_min
        for _ in range(HORIZON_DAYS):
            wday = (time.localtime(time.mktime((y, mo, d, 12, 0, 0, 0, 0, -1))).tm_wday + 1) % 7
            if self.day_matches(d, mo, wday):
                for h in sorted(self.hours):
                    if h < first_h:
                        continue
                    start = first_m if h == first_h else 0
                    mins = [m for m in sorted(self.minutes) if m >= start]
                    if mins:
                        return time.mktime((y, mo, d, h, mins[0], 0, 0, 0, -1))
            # the next day, at midnight
            nxt = time.localtime(time.mktime((y, mo, d + 1, 12, 0, 0, 0, 0, -1)))
            y, mo, d = nxt.tm_year, nxt.tm_mon, nxt.tm_mday
            first_h, first_m = 0, 0
        return None


def parse(text: str) -> Cron:
    """Five fields or an ``@`` alias; ValueError naming the field that does not read."""
    text = ALIASES.get(text.strip().lower(), text)
    fields = text.split()
    if len(fields) != 5:
        raise ValueError(f"expected five fields (minute hour day month weekday), got {text!r}")
    names = ("minute", "hour", "day", "month", "weekday")
    sets = [
        _field(f, lo, hi, nm, what)
        for f, (lo, hi, nm), what in zip(fields, _RANGES, names, strict=True)
    ]
    weekdays = frozenset(0 if w == 7 else w for w in sets[4])
    return Cron(
        frozenset(sets[0]), frozenset(sets[1]), frozenset(sets[2]), frozenset(sets[3]),
        weekdays, fields[2].startswith("*"), fields[4].startswith("*"),
    )  # fmt: skip


def _field(text: str, lo: int, hi: int, names: dict[str, int], what: str) -> set[int]:
    out: set[int] = set()
    for part in text.lower().split(","):
        base, _, step_s = part.partition("/")
        try:
            step = int(step_s) if step_s else 1
            if base == "*":
                a, b = lo, hi
            elif "-" in base:
                x, y = base.split("-", 1)
                a, b = _value(x, names), _value(y, names)
            else:
                a = _value(base, names)
                b = hi if step_s else a
        except ValueError:
            raise ValueError(f"{what}: cannot read {part!r}") from None
        if step < 1 or not lo <= a <= b <= hi:
            raise ValueError(f"{what}: {part!r} is outside {lo}-{hi}")
        out.update(range(a, b + 1, step))
    return out


def _value(text: str, names: dict[str, int]) -> int:
    if text in names:
        return names[text]
    return int(text)
