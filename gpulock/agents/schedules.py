"""Fleet schedules: crontab expressions read as cron reads them, and the APScheduler triggers.

A schedule is a crontab expression (5 fields, or 6 with seconds first, or ``@daily`` and
friends) or an interval (``every: 2s``, a ``TriggerSpec`` with ``every_s``).  It means what it
means to cron, not what APScheduler 3 would make of it: day-of-week 0 and 7 are Sunday
(APScheduler 3 counts from Monday), and a day-of-month and a day-of-week that are both
restricted match either one (cron's rule; APScheduler would want both).

``parse_schedule`` and ``cron_weekdays`` are pure.  ``make_trigger`` and ``next_fires`` build
and ask APScheduler's triggers, importing APScheduler inside the function, so that importing
this module (and ``gpulock.agents.fleet``, ``gpulock.agents.fleetfile``) stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from gpulock.core import cronexpr

__all__ = [
    "DRY_RUN_FIRES",
    "SCHEDULE_HINT",
    "CronFields",
    "TriggerSpec",
    "cron_weekdays",
    "make_trigger",
    "next_fires",
    "parse_schedule",
]

DRY_RUN_FIRES: Final = 3
SCHEDULE_HINT: Final = (
    "crontab: minute hour day month weekday, e.g. '*/5 * * * *' or '0 3 * * 1-5' "
    "(a sixth field in front is seconds); or use every: 10m"
)
_ALIASES: Final = cronexpr.ALIASES  # one list of @daily and friends, shared with foresight
_WEEKDAYS: Final = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # cron's numbering: 0..6


@dataclass(frozen=True, slots=True)
class CronFields:
    """Keyword arguments of one APScheduler ``CronTrigger``, already in APScheduler's terms."""

    second: str
    minute: str
    hour: str
    day: str
    month: str
    day_of_week: str

    def kwargs(self) -> dict[str, str]:
        return {
            "second": self.second,
            "minute": self.minute,
            "hour": self.hour,
            "day": self.day,
            "month": self.month,
            "day_of_week": self.day_of_week,
        }


@dataclass(frozen=True, slots=True)
class TriggerSpec:
    """When a job fires: every ``every_s`` seconds, or when any of ``cron`` matches."""

    text: str  # for people: "cron */5 * * * *", "every 2s"
    every_s: float | None = None
    cron: tuple[CronFields, ...] = ()  # two: cron's day-of-month OR day-of-week rule


# --- crontab, as cron reads it (pure) ----------------------------------------------------------


def parse_schedule(text: str) -> tuple[CronFields, ...]:
    """A crontab expression -> the CronTrigger arguments that fire exactly when cron would.

    Raises ValueError for what cron would refuse here; APScheduler judges the values of the
    fields (``gpulock.agents.fleetfile.check_schedules``).
    """
    expr = text.strip()
    if expr.startswith("@"):
        if expr == "@reboot":
            raise ValueError(
                "'@reboot' is not a clock time; run 'gpulock fleet FILE --once NAME' at boot"
            )
        if expr not in _ALIASES:
            raise ValueError(f"unknown schedule {expr!r}; known: {', '.join(_ALIASES)}")
        expr = _ALIASES[expr]
    fields = expr.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    elif len(fields) != 6:
        raise ValueError(f"expected 5 crontab fields (or 6 with seconds), got {len(fields)}")
    second, minute, hour, day, month, weekday = fields
    day_of_week = cron_weekdays(weekday)
    if day.startswith("*") or weekday.startswith("*"):
        return (CronFields(second, minute, hour, day, month, day_of_week),)
    # cron: when both are restricted, a day matching either one fires.
    return (
        CronFields(second, minute, hour, day, month, "*"),
        CronFields(second, minute, hour, "*", month, day_of_week),
    )


def cron_weekdays(field: str) -> str:
    """Cron's day-of-week field (0 or 7 = Sunday, names, ranges, steps) -> APScheduler's.

    APScheduler 3 numbers Monday 0, so numbers are turned into the names both agree on.
    """
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for item in field.lower().split(","):
        base, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise ValueError(f"day of week: bad step in {item!r}")
            step = int(step_text)
        if base == "*":
            first, last = 0, 6
        elif "-" in base:
            a, _, b = base.partition("-")
            first, last = _weekday(a), _weekday(b)
            if last == 0 and first > 0:
                last = 7  # "5-7" and "fri-sun" end on Sunday
            if first > last:
                raise ValueError(f"day of week: range {item!r} runs backwards")
        else:
            first = _weekday(base)
            last = 6 if step_text else first
        days.update(d % 7 for d in range(first, last + 1, step))
    if len(days) == 7:
        return "*"
    return ",".join(_WEEKDAYS[d] for d in sorted(days))


def _weekday(text: str) -> int:
    t = text.strip()
    if t.isdigit() and int(t) <= 7:
        return int(t) % 7
    if t[:3] in _WEEKDAYS and len(t) == 3:
        return _WEEKDAYS.index(t)
    raise ValueError(f"day of week: {text!r} is not 0-7 or sun..sat")


# --- APScheduler triggers (imported inside the functions only) ---------------------------------


class Scheduled(Protocol):
    """What a trigger is made from (a fleet's ``JobSpec``)."""

    @property
    def trigger(self) -> TriggerSpec: ...
    @property
    def jitter_s(self) -> float: ...


def make_trigger(spec: Scheduled, *, jitter: bool = True) -> Any:
    """The APScheduler trigger of ``spec`` (its jitter left out with ``jitter=False``)."""
    from apscheduler.triggers.combining import OrTrigger
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    j = spec.jitter_s if jitter and spec.jitter_s > 0 else None
    t = spec.trigger
    if t.every_s is not None:
        return IntervalTrigger(seconds=t.every_s, jitter=j)
    if len(t.cron) == 1:
        return CronTrigger(**t.cron[0].kwargs(), jitter=j)
    return OrTrigger([CronTrigger(**f.kwargs()) for f in t.cron], jitter=j)


def next_fires(trigger: Any, now: datetime, n: int = DRY_RUN_FIRES) -> list[datetime]:
    """The next ``n`` fire times of ``trigger`` after ``now`` (an aware datetime)."""
    out: list[datetime] = []
    previous = None
    while len(out) < n:
        fire = trigger.get_next_fire_time(previous, previous or now)
        if fire is None:
            break
        out.append(fire)
        previous = fire
    return out
