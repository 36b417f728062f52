"""What the router remembers between processes: cooldowns, today's cloud spend, recent requests.

Agents are short-lived: a cron job that met an HTTP 429 at 10:01 is gone by 10:02, and the next
one must not walk into the same wall.  So the memory is a small JSON file,
``<state>/router/ledger.json`` (format ``gpulock.ledger/1``), changed under an ``flock`` of
``ledger.lock`` (read, change, atomic replace) so that two agents finishing at once both count.
``gpulock status`` reads it, without the router, to show today's spend.

Spend is kept per calendar day and forgotten the next day: the local day on a host alone, the UTC
day in a cluster (a ``cluster:`` section), the day the cluster's Redis keeps, so hosts in other
time zones count the same day and the refill from this ledger matches it.  Requests are kept
as counts per whole second (a rate limit's window: ``requests_last_min``), and only for the
last minute, so the file stays the same size however busy the endpoint; a cooldown until it
ends.  A damaged file is read as empty, and a
damaged entry (a number that is text, NaN or infinite) is dropped: losing a cooldown costs one
failed request, never a crash, and a garbage number must not switch a budget or a rate limit off,
or on for ever.  A lock or ledger that is not a regular file (a symlink, a folder, a FIFO) is a
StateDirError with a hint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulock.core import state, statefile
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.units import calendar_day

FORMAT = "gpulock.ledger/1"
FOLDER = "router"
FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
_HINT = "move it away, or check the router folder's owner and mode (ls -la)"
RATE_WINDOW_S = 60.0
# A request is kept in the count of the whole second it started in (the wall clock's second).
# That second counts while ``now - second < RATE_WINDOW_S + 1``: a request that started at its
# very end is still counted a full minute later, never less (the window errs one second long,
# never short: a limit is never passed, and a Retry-After may say 61 s).
WINDOW_SPAN_S = RATE_WINDOW_S + 1
MAX_COUNT = 1 << 40  # more requests than any second holds: a damaged count, dropped
# "host": the cluster host that ran the call (a peer's name for a call sent there); counted only
# for calls that name one (in a cluster), and absent from older files, which still load.
USAGE_AXES = ("agent", "task", "tier", "host")
USAGE_FIELDS = ("calls", "tokens_in", "tokens_out", "cost_usd")


def utc_day(settings: Settings) -> bool:
    """Does this host count the UTC day?  In a cluster it does (as the cluster's Redis does)."""
    return settings.config.section("cluster") is not None


@dataclass(slots=True)
class Ledger:
    day: str
    spend_usd: dict[str, float] = field(default_factory=dict)  # by cid, today
    # by cid: requests started in each whole second of the last minute (wall clock)
    requests: dict[str, dict[int, int]] = field(default_factory=dict)
    cooldowns: dict[str, dict[str, Any]] = field(default_factory=dict)  # cid -> until/reason/n
    # Today's calls, tokens and cost by "agent", "task", "tier" and, in a cluster, "host" (what
    # gpulock status sums).
    usage: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # requests_last_min's answer for one whole second (it changes only when a second begins,
    # or with take_requests / give_back_requests): serve asks it on every request.
    _counted: tuple[int, dict[str, int]] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "day": self.day,
            "spend_usd": self.spend_usd,
            "requests": {k: {str(s): n for s, n in w.items()} for k, w in self.requests.items()},
            "cooldowns": self.cooldowns,
            "usage": self.usage,
        }

    def cooldown_until(self) -> dict[str, tuple[float, str]]:
        out = {}
        for key, c in self.cooldowns.items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out[key] = (float(c["until_wall"]), str(c.get("reason", "")))
        return out

    def requests_last_min(self, now_wall: float) -> dict[str, int]:
        """Requests of the last minute by cid (never changed by the caller)."""
        second = int(now_wall // 1)
        got = self._counted
        if got is not None and got[0] == second:
            return got[1]
        counts = {k: window_count(w, now_wall) for k, w in self.requests.items()}
        self._counted = (second, counts)
        return counts

    def take_requests(self, key: str, now_wall: float, n: int = 1) -> None:
        """Count ``n`` requests of ``key`` as started now (in this second)."""
        if n <= 0:
            return
        self._counted = None
        w = self.requests.setdefault(key, {})
        second = int(now_wall // 1)
        w[second] = w.get(second, 0) + n
        if len(w) > 2 * WINDOW_SPAN_S:  # a long-lived view (serve's) drops what left
            for old in [s for s in w if now_wall - s >= WINDOW_SPAN_S]:
                del w[old]

    def give_back_requests(self, key: str, second: int, n: int) -> None:
        """Uncount ``n`` requests counted in ``second`` that were never made (a block's unused
        part, ``gpulock.router.allowance``)."""
        w = self.requests.get(key)
        if w is None or n <= 0 or second not in w:
            return
        self._counted = None
        left = w[second] - n
        if left > 0:
            w[second] = left
        else:
            del w[second]
            if not w:
                del self.requests[key]

    def first_leaves_in(self, key: str, limit: int, now_wall: float) -> float | None:
        """Seconds until one more request of ``key`` fits under ``limit`` (None: one fits now,
        or none of those counted leaves)."""
        w = sorted((s, n) for s, n in self.requests.get(key, {}).items() if in_window(s, now_wall))
        over = sum(n for _, n in w) - limit  # this many must leave before one more may start
        if over < 0:
            return None
        gone = 0
        for s, n in w:
            gone += n
            if gone > over:
                return s + WINDOW_SPAN_S - now_wall
        return None


def in_window(second: int, now_wall: float) -> bool:
    return now_wall - second < WINDOW_SPAN_S


def window_count(w: dict[int, int], now_wall: float) -> int:
    """Requests of the last minute in one endpoint's counts by second."""
    return sum(n for s, n in w.items() if now_wall - s < WINDOW_SPAN_S)


def _num(v: Any) -> float | None:
    """A finite number from the file, else None (text, bool, NaN, infinity, a huge integer)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _window(counts: Any, now_wall: float) -> dict[int, int] | None:
    """One endpoint's requests by second from the file (``{"1764158400": 3}``; a list of wall
    times from an older file counts a request each), only the seconds of the window on either
    side of now (a time far in the future would count for ever), else None."""
    pairs: list[tuple[Any, Any]]
    if isinstance(counts, dict):
        pairs = list(counts.items())
    elif isinstance(counts, list):
        pairs = [(t, 1) for t in counts]
    else:
        return None
    w: dict[int, int] = {}
    for s, n in pairs:
        try:
            second = _num(float(s) if isinstance(s, str) else s)
        except ValueError:
            continue
        if second is None or abs(now_wall - second) >= WINDOW_SPAN_S:
            continue
        count = _num(n)
        if count is None or not 0 < count < MAX_COUNT:
            continue
        key = int(second // 1)
        w[key] = w.get(key, 0) + int(count)
    return w or None


def parse(data: bytes | None, now_wall: float, *, utc: bool = False) -> Ledger:
    """The ledger in ``data``, with yesterday's spend and expired or damaged entries dropped
    (``utc``: the day is the UTC day, as in a cluster)."""
    day = calendar_day(now_wall, utc=utc)
    fresh = Ledger(day)
    if not data:
        return fresh
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        return fresh
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return fresh
    led = Ledger(day)
    if raw.get("day") == day and isinstance(raw.get("spend_usd"), dict):
        for k, v in raw["spend_usd"].items():
            if (usd := _num(v)) is not None and usd >= 0:
                led.spend_usd[str(k)] = usd
    if raw.get("day") == day and isinstance(raw.get("usage"), dict):
        for axis in USAGE_AXES:
            rows = raw["usage"].get(axis)
            if isinstance(rows, dict):
                led.usage[axis] = {
                    str(k): {f: _num(row.get(f)) or 0.0 for f in USAGE_FIELDS}
                    for k, row in rows.items()
                    if isinstance(row, dict)
                }
    if isinstance(raw.get("requests"), dict):
        for k, counts in raw["requests"].items():
            if (w := _window(counts, now_wall)) is not None:
                led.requests[str(k)] = w
    if isinstance(raw.get("cooldowns"), dict):
        for k, c in raw["cooldowns"].items():
            if not isinstance(c, dict) or (until := _num(c.get("until_wall"))) is None:
                continue
            # Kept a day past its end: "failures in a row" doubles the next cooldown.  One that
            # ends more than a day from now was not written by record_failure (10 min at most).
            if abs(now_wall - until) < 86400:
                failures = _num(c.get("failures"))
                led.cooldowns[str(k)] = {
                    "until_wall": until,
                    "reason": str(c.get("reason", "")),
                    "failures": int(min(max(failures or 0, 0), 64)),
                }
    return led


def path(settings: Settings) -> Path:
    return settings.state_dir / FOLDER / FILE


def read(settings: Settings, *, now_wall: float | None = None) -> Ledger:
    now = time.time() if now_wall is None else now_wall
    try:
        data = statefile.read_small(path(settings))
    except (OSError, StateDirError):
        data = None
    return parse(data, now, utc=utc_day(settings))


_PEEKED: dict[str, tuple[tuple[int, int, int, str], Ledger]] = {}


def peek(settings: Settings, *, now_wall: float | None = None) -> Ledger:
    """``read`` for a caller that only looks (never changes what it is given): parsed again only
    when the file was replaced or the day changed, so a gateway judging every request reads a
    ``stat``, not the file."""
    now = time.time() if now_wall is None else now_wall
    p = path(settings)
    try:
        st = os.stat(p)
    except OSError:
        return read(settings, now_wall=now)
    key = (st.st_ino, st.st_mtime_ns, st.st_size, calendar_day(now, utc=utc_day(settings)))
    hit = _PEEKED.get(str(p))
    if hit is not None and hit[0] == key:
        return hit[1]
    led = read(settings, now_wall=now)
    _PEEKED[str(p)] = (key, led)
    return led


@contextlib.contextmanager
def change(settings: Settings, *, now_wall: float | None = None) -> Iterator[Ledger]:
    """Read, let the caller change, and write back the ledger, all under its lock.

    StateDirError (with a hint) when the lock or the ledger cannot be used.
    """
    folder = state.ensure_subdir(settings.state_dir, FOLDER, group=settings.group)
    lock = folder / LOCK_FILE
    try:
        fd = statefile.open_regular(lock, os.O_RDWR | os.O_CREAT, settings.file_mode)
    except OSError as e:
        raise StateDirError(
            str(lock), f"cannot open the ledger's lock: {e.strerror or e}", hint=_HINT
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        led = read(settings, now_wall=now_wall)
        yield led
        data = json.dumps(led.to_json(), separators=(",", ":")).encode()
        try:
            statefile.atomic_write(folder / FILE, data, mode=settings.file_mode)
        except OSError as e:
            raise StateDirError(
                str(folder / FILE), f"cannot write the ledger: {e.strerror or e}", hint=_HINT
            ) from None
    finally:
        os.close(fd)


def record_call(
    settings: Settings,
    key: str,
    *,
    cost_usd: float,
    agent: str = "",
    task: str = "",
    tier: str = "",
    tokens_in: int = 0,
    tokens_out: int = 0,
    count_request: bool = True,
    reserved_usd: float = 0.0,
    host: str = "",
    now_wall: float | None = None,
) -> None:
    """Count one request, its tokens and cost; a success also ends the failures-in-a-row count.

    ``count_request=False``: the request is already in the rate limit's window (counted when
    it began, by ``gpulock.router.accounting.admit``).  ``reserved_usd``: what ``reserve`` already
    counted for this call (settled here).  ``host``: the cluster host that ran it ("" none)."""
    call = Call(
        key, cost_usd, agent, task, tier, tokens_in, tokens_out, count_request, reserved_usd, host
    )
    record_calls(settings, [call], now_wall=now_wall)


@dataclass(frozen=True)
class Call:
    """One answered call, as ``record_call`` counts it."""

    key: str
    cost_usd: float
    agent: str = ""
    task: str = ""
    tier: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    count_request: bool = True
    reserved_usd: float = 0.0
    host: str = ""  # the cluster host that ran it; "" outside a cluster (no host axis)


def record_calls(
    settings: Settings, calls: Sequence[Call], *, now_wall: float | None = None
) -> None:
    """``record_call`` for each of ``calls``, in one locked change of the ledger."""
    now = time.time() if now_wall is None else now_wall
    with change(settings, now_wall=now) as led:
        for k in calls:
            count(led, k, now)


def count(led: Ledger, k: Call, now: float) -> None:
    """Add one answered call to ``led`` (in memory)."""
    for axis, name in zip(USAGE_AXES, (k.agent, k.task, k.tier, k.host), strict=True):
        if axis == "host" and not name:
            continue
        row = led.usage.setdefault(axis, {}).setdefault(name, dict.fromkeys(USAGE_FIELDS, 0.0))
        row["calls"] += 1
        row["tokens_in"] += k.tokens_in
        row["tokens_out"] += k.tokens_out
        row["cost_usd"] = round(row["cost_usd"] + k.cost_usd, 8)
    if k.count_request and (k.tier == "cloud" or not k.tier):
        led.take_requests(k.key, now)
    if k.cost_usd or k.reserved_usd:
        spent = led.spend_usd.get(k.key, 0.0) + k.cost_usd - k.reserved_usd
        led.spend_usd[k.key] = round(max(0.0, spent), 8)
    c = led.cooldowns.get(k.key)
    if c is not None and c.get("until_wall", 0) <= now:
        del led.cooldowns[k.key]


def record_failure(
    settings: Settings,
    key: str,
    *,
    reason: str,
    base_s: float,
    max_s: float,
    retry_after_s: float | None = None,
    count_request: bool = True,
    now_wall: float | None = None,
) -> float:
    """Start a cooldown for ``key``: ``base_s`` doubled for each failure in a row, or the
    server's Retry-After when it gave one.  Returns the cooldown's length in seconds.
    ``count_request=False``: the request is already in the rate limit's window."""
    now = time.time() if now_wall is None else now_wall
    with change(settings, now_wall=now) as led:
        prev = led.cooldowns.get(key) or {}
        n = int(prev.get("failures", 0)) + 1
        length = float(min(max_s, base_s * 2 ** (n - 1)))
        if retry_after_s is not None and retry_after_s > 0:
            length = min(max_s, retry_after_s)
        led.cooldowns[key] = {"until_wall": now + length, "reason": reason, "failures": n}
        if count_request:
            led.take_requests(key, now)
    return length


def reserve(
    settings: Settings,
    key: str,
    amount_usd: float,
    *,
    model_budget_usd: float | None,
    total_budget_usd: float | None,
    now_wall: float | None = None,
) -> tuple[bool, float, float]:
    """Check and count a call's most cost before it runs, under the ledger's lock: two agents
    at once never spend past a budget (checking before and counting after does).  Returns
    (reserved?, the model's spend today, all cloud spend today), before this one."""
    now = time.time() if now_wall is None else now_wall
    with change(settings, now_wall=now) as led:
        model = led.spend_usd.get(key, 0.0)
        total = sum(led.spend_usd.values())
        over_model = model_budget_usd is not None and model + amount_usd > model_budget_usd + 1e-9
        over_all = total_budget_usd is not None and total + amount_usd > total_budget_usd + 1e-9
        if over_model or over_all:
            return False, model, total
        led.spend_usd[key] = round(model + amount_usd, 8)
    return True, model, total


def release(
    settings: Settings, key: str, amount_usd: float, *, now_wall: float | None = None
) -> None:
    """Give back a reservation whose call failed (it cost nothing)."""
    with change(settings, now_wall=now_wall) as led:
        led.spend_usd[key] = round(max(0.0, led.spend_usd.get(key, 0.0) - amount_usd), 8)
