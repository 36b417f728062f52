from __future__ import annotations

import math
import time

import pytest

from gpulock.core.units import (
    calendar_day,
    format_duration,
    format_size,
    parse_clock,
    parse_duration,
    parse_size,
    parse_usd,
)

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1024, 1024),
        (1024.0, 1024),
        ("1024", 1024),
        (" 1024 ", 1024),
        ("512B", 512),
        ("512 b", 512),
        ("800MiB", 800 * MIB),
        ("800 MiB", 800 * MIB),
        ("800mib", 800 * MIB),
        ("6GiB", 6 * GIB),
        ("6gib", 6 * GIB),
        ("6 GIB", 6 * GIB),
        ("1.5GiB", 3 * GIB // 2),
        ("2GB", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("1.1GB", 1_100_000_000),
        ("3kB", 3000),
        ("3KB", 3000),
        ("5MB", 5 * 10**6),
        ("1TB", 10**12),
        ("512M", 512 * MIB),
        ("6G", 6 * GIB),
        ("1T", TIB),
        ("4K", 4 * KIB),
        ("4KiB", 4 * KIB),
        ("2TiB", 2 * TIB),
        ("8Gi", 8 * GIB),
        (".5GiB", GIB // 2),
    ],
)
def test_parse_size_good(value: str | int | float, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    ("value", "total", "expected"),
    [
        ("10%", 1000, 100),
        ("10 %", 1000, 100),
        ("12.5%", 8 * GIB, GIB),
        ("0%", 1000, 0),
        ("100%", 1000, 1000),
        ("6GiB", 10, 6 * GIB),  # an absolute size ignores the total
    ],
)
def test_parse_size_percent(value: str, total: int, expected: int) -> None:
    assert parse_size(value, total_bytes=total) == expected


def test_parse_size_percent_needs_total() -> None:
    with pytest.raises(ValueError, match=r"'10%'.*percentage.*known total"):
        parse_size("10%")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("banana", "'banana' is not a size"),
        ("", "'' is not a size"),
        ("   ", "'   ' is not a size"),
        ("-5GiB", "'-5GiB' is negative"),
        ("-1", "'-1' is negative"),
        (-1, "-1 is negative"),
        (-0.5, "-0.5 is negative"),
        (math.nan, "nan is not a size"),
        (math.inf, "inf is not a size"),
        ("nan", "'nan' is not a size"),
        ("inf", "'inf' is not a size"),
        (True, "True is not a size"),
        (False, "False is not a size"),
        ("6 GiBs", "unknown unit 'GiBs'"),
        ("6 XB", "unknown unit 'XB'"),
        ("6GiB6", "is not a size"),
        ("1,5GiB", "is not a size"),
        ("150%", "more than 100%"),
    ],
)
def test_parse_size_bad(value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_size(value, total_bytes=1000)  # type: ignore[arg-type]
    message = str(caught.value)
    assert fragment in message
    if "percentage" not in message:
        assert "expected a size like 6GiB, 800MiB or 10%" in message


def test_parse_size_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"^--need: 'lots' is not a size"):
        parse_size("lots", key="--need")


def test_parse_size_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (None, "?"),
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (800 * MIB, "800 MiB"),
        (100 * MIB, "100 MiB"),
        (99 * MIB + MIB // 2, "99.5 MiB"),
        (6 * GIB, "6.0 GiB"),
        (6 * GIB + 400 * MIB, "6.4 GiB"),
        (24 * GIB, "24.0 GiB"),
        (3 * TIB // 2, "1.5 TiB"),
        (1024 * MIB - 1, "1.0 GiB"),  # rounds up into the next unit, not "1024 MiB"
        (5 * 1024**5, "5.0 PiB"),
        (4096 * 1024**5, "4096 PiB"),  # the last unit carries on
        (-2 * GIB, "-2.0 GiB"),
    ],
)
def test_format_size(n: int | None, expected: str) -> None:
    assert format_size(n) == expected


@pytest.mark.parametrize("text", ["512 B", "800 MiB", "6.0 GiB", "1.5 TiB"])
def test_format_size_round_trips(text: str) -> None:
    assert format_size(parse_size(text)) == text


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (10, 10.0),
        (2.5, 2.5),
        (0, 0.0),
        ("10", 10.0),
        ("2.5", 2.5),
        ("10s", 10.0),
        ("10 s", 10.0),
        ("10S", 10.0),
        ("250ms", 0.25),
        ("5m", 300.0),
        ("5min", 300.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("1w", 604800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("1m30s", 90.0),
        ("1.5h", 5400.0),
        ("2d3h", 2 * 86400.0 + 3 * 3600.0),
        ("1s500ms", 1.5),
    ],
)
def test_parse_duration_good(value: str | int | float, expected: float) -> None:
    assert parse_duration(value) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("banana", "'banana' is not a duration"),
        ("", "'' is not a duration"),
        ("-5s", "'-5s' is negative"),
        (-5, "-5 is negative"),
        ("-5", "'-5' is negative"),
        ("5 fortnights", "unknown unit 'fortnights'"),
        ("1h30", "'1h30' is not a duration"),
        ("1h-30m", "'1h-30m' is not a duration"),
        ("h", "'h' is not a duration"),
        (math.nan, "nan is not a duration"),
        ("inf", "'inf' is not a duration"),
        (True, "True is not a duration"),
        ("1e999", "too large"),
    ],
)
def test_parse_duration_bad(value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_duration(value)  # type: ignore[arg-type]
    assert fragment in str(caught.value)
    assert "expected a duration like 30s, 5m or 1h" in str(caught.value)


def test_parse_duration_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"^--timeout: 'soon' is not a duration"):
        parse_duration("soon", key="--timeout")


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (None, "?"),
        (math.nan, "?"),
        (math.inf, "?"),
        (0, "0 ms"),
        (0.012, "12 ms"),
        (0.9994, "999 ms"),
        (0.9996, "1.0 s"),
        (4.2, "4.2 s"),
        (59.9, "59.9 s"),
        (59.97, "1m00s"),
        (185, "3m05s"),
        (3599.6, "1h00m"),
        (2 * 3600 + 10 * 60, "2h10m"),
        (86399, "1d00h"),
        (86400 + 2 * 3600, "1d02h"),
        (10 * 86400, "10d00h"),
        (-4.2, "-4.2 s"),
    ],
)
def test_format_duration(seconds: float | None, expected: str) -> None:
    assert format_duration(seconds) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("22:00", (22, 0)),
        ("07:30", (7, 30)),
        ("7:05", (7, 5)),
        ("0:00", (0, 0)),
        ("23:59", (23, 59)),
    ],
)
def test_parse_clock_good(value: str, expected: tuple[int, int]) -> None:
    assert parse_clock(value) == expected


@pytest.mark.parametrize("value", ["24:00", "12:60", "12", "12:5", "noon", "", "12:00:00", "-1:00"])
def test_parse_clock_bad(value: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_clock(value, key="quiet_from")
    assert str(caught.value).startswith(f"quiet_from: {value!r} is not a time of day")
    assert "22:00" in str(caught.value)


def test_parse_clock_explains_yaml_sexagesimal() -> None:
    # YAML 1.1 reads an unquoted 22:00 as 22*60 + 0.
    with pytest.raises(ValueError, match=r"1320 is a number.*quotes"):
        parse_clock(1320)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "amount"), [(5, 5.0), ("5.00", 5.0), ("$0.05", 0.05), (0, 0.0)])
def test_usd_amounts_as_configs_write_them(value: object, amount: float) -> None:
    assert parse_usd(value) == amount


@pytest.mark.parametrize(
    ("value", "problem"),
    [("five", "like 5"), (True, "like 5"), ([5], "like 5"), ("-1", ">= 0"), ("nan", ">= 0")],
)
def test_a_bad_usd_amount_says_what_is_wrong(value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=f"expected an amount in USD {problem}"):
        parse_usd(value)


def test_the_calendar_day_is_local_or_utc() -> None:
    t = 1_795_600_000.0  # 2026-11-25 09:46 UTC
    assert calendar_day(t, utc=True) == "2026-11-25"
    assert calendar_day(t) == time.strftime("%Y-%m-%d", time.localtime(t))


# --- GPU sets (--gpu, default_gpu, acquire(gpu=...)) -------------------------------------------


@pytest.mark.parametrize(
    ("raw", "spec"),
    [
        (0, 0),
        ("3", 3),
        ("any", "any"),
        (" ANY ", "any"),
        ("0,2", (0, 2)),
        ("2,0,2", (0, 2)),
        ([2, 0], (0, 2)),
        ("1,", 1),
        ([1], 1),
    ],
)
def test_parse_gpus(raw: object, spec: object) -> None:
    from gpulock.core.units import parse_gpus

    assert parse_gpus(raw) == spec


@pytest.mark.parametrize("raw", ["", "x", "-1", -1, "0,,2", "a,b", [], [True], True, 1.5, "0 2"])
def test_parse_gpus_refuses_with_an_example(raw: object) -> None:
    from gpulock.core.units import parse_gpus

    with pytest.raises(ValueError, match=r"^--gpu: expected a GPU index like 0, a set like 0,2"):
        parse_gpus(raw, key="--gpu")


def test_format_gpus() -> None:
    from gpulock.core.units import format_gpus

    assert format_gpus((1,)) == "gpu1"
    assert format_gpus((0, 2)) == "gpus 0,2"
    assert format_gpus((3, 2, 1, 0)) == "gpus 0-3"
    assert format_gpus((0, 1, 2, 5, 7, 8, 9)) == "gpus 0-2,5,7-9"
