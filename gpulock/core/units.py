"""Sizes, durations and clock times as people write them, and back.

Pure functions, no I/O.  Parsers raise ``ValueError`` whose message quotes the bad value and shows
a good one; with ``key`` the message starts with ``key: `` so a command-line flag or a config key
can be named.  The config loader leaves ``key`` out and wraps the message in a ``ConfigError`` that
also carries the file and line.

Sizes: a bare number is bytes.  ``K M G T P`` alone and ``KiB MiB GiB TiB PiB`` are binary (as
``ls -h`` prints them), ``kB MB GB TB PB`` are decimal (as disks are sold); units are
case-insensitive.  ``10%`` is a share of a known total.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

__all__ = [
    "MIN_GPU_BYTES",
    "format_duration",
    "format_gpus",
    "format_size",
    "format_usd",
    "gpu_size_mistake",
    "parse_clock",
    "parse_duration",
    "parse_gpus",
    "parse_size",
]

# What a ticket may ask for (``--gpu``, ``default_gpu``, ``acquire(gpu=...)``): one GPU, a set of
# GPUs, or "any" (every GPU this machine has).
GpuSpec = int | tuple[int, ...] | str
_GPUS_EXAMPLE = "expected a GPU index like 0, a set like 0,2, or any"

_SIZE_EXAMPLE = "expected a size like 6GiB, 800MiB or 10%"
_DURATION_EXAMPLE = "expected a duration like 30s, 5m or 1h"
_CLOCK_EXAMPLE = "expected a time of day like 22:00 or 07:30"

_KIB = 1024
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "k": _KIB,
    "ki": _KIB,
    "kib": _KIB,
    "m": _KIB**2,
    "mi": _KIB**2,
    "mib": _KIB**2,
    "g": _KIB**3,
    "gi": _KIB**3,
    "gib": _KIB**3,
    "t": _KIB**4,
    "ti": _KIB**4,
    "tib": _KIB**4,
    "p": _KIB**5,
    "pi": _KIB**5,
    "pib": _KIB**5,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}

# Smallest first: format_size walks up until the number is below 1024 of the unit.
_SIZE_NAMES: tuple[tuple[str, int], ...] = (
    ("KiB", _KIB),
    ("MiB", _KIB**2),
    ("GiB", _KIB**3),
    ("TiB", _KIB**4),
    ("PiB", _KIB**5),
)

_DURATION_UNITS: dict[str, Decimal] = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "sec": Decimal(1),
    "secs": Decimal(1),
    "m": Decimal(60),
    "min": Decimal(60),
    "mins": Decimal(60),
    "h": Decimal(3600),
    "hr": Decimal(3600),
    "hrs": Decimal(3600),
    "d": Decimal(86400),
    "w": Decimal(7 * 86400),
}

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_SIZE_RE = re.compile(rf"\s*({_NUMBER})\s*([A-Za-z]*|%)\s*")
_DURATION_PART_RE = re.compile(rf"\s*({_NUMBER})\s*([A-Za-z]+)")
_CLOCK_RE = re.compile(r"\s*(\d{1,2}):(\d{2})\s*")


def _fail(key: str | None, value: object, problem: str, example: str) -> ValueError:
    prefix = f"{key}: " if key else ""
    return ValueError(f"{prefix}{value!r} {problem}: {example}")


def _number(value: str | int | float, key: str | None, example: str, what: str) -> Decimal | None:
    """Return a plain number as a Decimal, or None when ``value`` is a string with a unit.

    Decimal keeps "1.1GB" exact (float would give 1099999999.9999998).  bool is refused even
    though it is an int: ``reserve: yes`` is a mistake, not one byte.
    """
    if isinstance(value, bool):
        raise _fail(key, value, f"is not {what}", example)
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(key, value, f"is not {what}", example)
        number = Decimal(value)
    elif isinstance(value, str):
        try:
            number = Decimal(value.strip())
        except InvalidOperation:
            return None
        if not number.is_finite():
            raise _fail(key, value, f"is not {what}", example)
    else:
        raise _fail(key, value, f"is not {what}", example)
    if number < 0:
        raise _fail(key, value, "is negative", example)
    return number


def parse_size(
    value: str | int | float, *, total_bytes: int | None = None, key: str | None = None
) -> int:
    """Parse a size such as ``6GiB``, ``800 MiB``, ``2GB``, ``512M`` or ``10%`` into bytes.

    A percentage is of ``total_bytes`` (refused when it is None) and must be within 0-100%.
    Fractions of a byte are rounded to the nearest byte.
    """
    number = _number(value, key, _SIZE_EXAMPLE, "a size")
    if number is not None:
        return round(number)
    assert isinstance(value, str)  # _number returns None only for strings
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise _fail(key, value, "is not a size", _SIZE_EXAMPLE)
    amount = Decimal(match.group(1))
    unit = match.group(2).lower()
    if amount < 0:
        raise _fail(key, value, "is negative", _SIZE_EXAMPLE)
    if unit == "%":
        if total_bytes is None:
            raise _fail(
                key,
                value,
                "is a percentage, which needs a known total (the GPU's memory) and there is none "
                "here",
                "expected an absolute size like 6GiB or 800MiB",
            )
        if amount > 100:
            raise _fail(key, value, "is more than 100%", _SIZE_EXAMPLE)
        return round(Decimal(total_bytes) * amount / 100)
    factor = _SIZE_UNITS.get(unit)
    if factor is None:
        raise _fail(key, value, f"has an unknown unit {match.group(2)!r}", _SIZE_EXAMPLE)
    return round(amount * factor)


MIN_GPU_BYTES = 64 << 20  # no GPU is smaller: a simulated one below is a unit left out


def gpu_size_mistake(value: object, size: int) -> tuple[str, str] | None:
    """``(problem, hint)`` for a simulated GPU size below ``MIN_GPU_BYTES`` (``simulate: 24``
    is 24 bytes: a size without a unit counts bytes), the hint guessing GiB; None when fine."""
    if size >= MIN_GPU_BYTES:
        return None
    number = _SIZE_RE.fullmatch(str(value))
    guess = f"{number.group(1)}GiB" if number and number.group(1) else "24GiB"
    bare = number is not None and not number.group(2)
    return (
        f"a GPU of {format_size(size)} is too small to simulate (at least "
        f"{format_size(MIN_GPU_BYTES)})" + ("; a size without a unit counts bytes" if bare else ""),
        f"did you mean {guess}?",
    )


def format_size(n: int | None) -> str:
    """Format bytes for people: ``512 B``, ``800 MiB``, ``6.0 GiB``, ``1.5 TiB``; None is ``?``.

    Three significant digits at most; below 100 of a unit one decimal is shown so that ``6.0 GiB``
    and ``6.4 GiB`` can be told apart.
    """
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    size = abs(n)
    if size < _KIB:
        return f"{sign}{size} B"
    for index, (name, factor) in enumerate(_SIZE_NAMES):
        value = size / factor
        # Step up when rounding would print "1024 MiB" instead of "1.0 GiB".
        if round(value) >= _KIB and index + 1 < len(_SIZE_NAMES):
            continue
        if round(value, 1) < 100:
            return f"{sign}{value:.1f} {name}"
        return f"{sign}{value:.0f} {name}"
    raise AssertionError("unreachable: the last unit always returns")


def parse_duration(value: str | int | float, *, key: str | None = None) -> float:
    """Parse a duration such as ``10``, ``2.5``, ``250ms``, ``5m`` or ``1h30m`` into seconds.

    A bare number is seconds.  Parts add up (``1h30m``); units are ``ms s m h d w`` (also ``sec``,
    ``min``, ``hr``) and case-insensitive, so ``5M`` is five minutes, never months.
    """
    number = _number(value, key, _DURATION_EXAMPLE, "a duration")
    if number is not None:
        if not math.isfinite(float(number)):  # "1e999" is a Decimal but not a float
            raise _fail(key, value, "is too large", _DURATION_EXAMPLE)
        return float(number)
    assert isinstance(value, str)  # _number returns None only for strings
    text = value.strip()
    total = Decimal(0)
    position = 0
    if not text:
        raise _fail(key, value, "is not a duration", _DURATION_EXAMPLE)
    while position < len(text):
        match = _DURATION_PART_RE.match(text, position)
        if match is None:
            raise _fail(key, value, "is not a duration", _DURATION_EXAMPLE)
        if position > 0 and match.group(1)[0] in "+-":
            raise _fail(key, value, "is not a duration", _DURATION_EXAMPLE)  # "1h-30m"
        amount = Decimal(match.group(1))
        if amount < 0:
            raise _fail(key, value, "is negative", _DURATION_EXAMPLE)
        unit = _DURATION_UNITS.get(match.group(2).lower())
        if unit is None:
            raise _fail(key, value, f"has an unknown unit {match.group(2)!r}", _DURATION_EXAMPLE)
        total += amount * unit
        position = match.end()
    return float(total)


def format_duration(s: float | None) -> str:
    """Format seconds for people: ``12 ms``, ``4.2 s``, ``3m05s``, ``2h10m``, ``1d02h``.

    None, NaN and infinity are ``?``.  Each form rounds to its last digit and moves to the next
    form when rounding reaches it (59.97 s is ``1m00s``, not ``60.0 s``).
    """
    if s is None or not math.isfinite(s * 1000):  # 1e306 s overflows once in ms
        return "?"
    sign = "-" if s < 0 else ""
    s = abs(s)
    if round(s * 1000) < 1000:
        return f"{sign}{round(s * 1000)} ms"
    if round(s, 1) < 60:
        return f"{sign}{s:.1f} s"
    whole_s = round(s)
    if whole_s < 3600:
        return f"{sign}{whole_s // 60}m{whole_s % 60:02d}s"
    whole_m = round(s / 60)
    if whole_m < 24 * 60:
        return f"{sign}{whole_m // 60}h{whole_m % 60:02d}m"
    whole_h = round(s / 3600)
    return f"{sign}{whole_h // 24}d{whole_h % 24:02d}h"


def parse_clock(value: str, *, key: str | None = None) -> tuple[int, int]:
    """Parse a time of day ``HH:MM`` (24-hour) into ``(hour, minute)``.

    Unquoted ``22:00`` in YAML 1.1 is the sexagesimal number 1320, so an int gets a hint to quote
    the value instead of a guess at what was meant.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        prefix = f"{key}: " if key else ""
        raise ValueError(
            f"{prefix}{value!r} is a number, not a time of day: {_CLOCK_EXAMPLE} "
            '(in YAML write it in quotes, "22:00": unquoted, 22:00 reads as the number 1320)'
        )
    if not isinstance(value, str):
        raise _fail(key, value, "is not a time of day", _CLOCK_EXAMPLE)
    match = _CLOCK_RE.fullmatch(value)
    if match is None:
        raise _fail(key, value, "is not a time of day", _CLOCK_EXAMPLE)
    hour, minute = int(match.group(1)), int(match.group(2))
    if hour > 23 or minute > 59:
        raise _fail(key, value, "is not a time of day", _CLOCK_EXAMPLE)
    return hour, minute


def parse_usd(value: object) -> float:
    """An amount in USD as a config writes it: ``5``, ``5.00``, ``"$5.00"``; >= 0 and finite.
    ValueError says what is wrong (a bool is refused: ``daily_budget: yes`` is a mistake)."""
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        amount = float(str(value).strip().lstrip("$"))
    except ValueError:
        raise ValueError(f"expected an amount in USD like 5.00, got {value!r}") from None
    if not 0 <= amount < math.inf:  # NaN fails the range too
        raise ValueError(f"expected an amount in USD >= 0, got {value!r}")
    return amount


def calendar_day(now_wall: float, *, utc: bool = False) -> str:
    """The day ``now_wall`` counts in, ``2026-11-26``: the local calendar day, or the UTC day
    (what a cluster's budgets count, so hosts in every time zone count the same day)."""
    return time.strftime("%Y-%m-%d", time.gmtime(now_wall) if utc else time.localtime(now_wall))


def day_ends_at(now_wall: float, *, utc: bool = False) -> float:
    """The wall time the day of ``now_wall`` (as ``calendar_day`` counts it) ends."""
    if utc:
        return (now_wall // 86400 + 1) * 86400
    t = time.localtime(now_wall)
    # mktime carries a 32nd into the next month, and -1 lets it find whether DST is in force.
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday + 1, 0, 0, 0, 0, 0, -1))


def format_usd(amount: float) -> str:
    """``$5.00``, ``$0.005``: cents at least, and every digit a small amount has (to 1e-6);
    rounding a $0.005 budget to "$0.01" would misstate it by half."""
    whole, _, cents = f"{amount:.6f}".rstrip("0").partition(".")
    return f"${whole}.{cents.ljust(2, '0')}"


def parse_gpus(value: object, *, key: str | None = None) -> GpuSpec:
    """``0`` -> 0; ``"0,2"`` or ``[0, 2]`` -> (0, 2) (sorted, each once); ``"any"`` -> "any".

    A set of one (``"1,"``, ``[1]``) is that index.  Anything else is a ValueError naming it.
    """
    prefix = f"{key}: " if key else ""
    if isinstance(value, bool):
        raise ValueError(f"{prefix}{_GPUS_EXAMPLE}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{prefix}{_GPUS_EXAMPLE}, got {value!r}")
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "any":
            return "any"
        parts = [p.strip() for p in text.split(",")]
        parts = parts[:-1] if len(parts) > 1 and not parts[-1] else parts
        if not parts or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"{prefix}{_GPUS_EXAMPLE}, got {value!r}")
        items: list[object] = [int(p) for p in parts]
    elif isinstance(value, list | tuple | set | frozenset):
        items = list(value)
    else:
        raise ValueError(f"{prefix}{_GPUS_EXAMPLE}, got {value!r}")
    if not items or not all(type(i) is int and i >= 0 for i in items):
        raise ValueError(f"{prefix}{_GPUS_EXAMPLE}, got {value!r}")
    gpus = tuple(sorted({i for i in items if isinstance(i, int)}))
    return gpus[0] if len(gpus) == 1 else gpus


def format_gpus(gpus: Sequence[int]) -> str:
    """``gpu1``; ``gpus 0,2``; ``gpus 0-3`` (a run of three or more)."""
    if len(gpus) == 1:
        return f"gpu{gpus[0]}"
    ordered = sorted(gpus)
    runs: list[str] = []
    start = prev = ordered[0]
    for g in [*ordered[1:], None]:
        if g is not None and g == prev + 1:
            prev = g
            continue
        run = range(start, prev + 1)
        runs.append(f"{start}-{prev}" if len(run) >= 3 else ",".join(map(str, run)))
        if g is not None:
            start = prev = g
    return "gpus " + ",".join(runs)
