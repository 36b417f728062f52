"""The ``watchdog:`` and ``governor:`` sections of the gpulock config, validated.

::

    watchdog:
      interval: 60s        # one pass every interval
      threshold: 85%       # evict idle models when a GPU's used memory passes this...
      schedule:            # ...or the threshold of the window in force (local time; a window
        - {from: "22:00", to: "06:00", threshold: 40%}   # may cross midnight; the shortest
      min_idle: 10m        # window that contains the time wins); only models idle this long
      hysteresis: 5%       # evict until used < threshold - hysteresis
      evict_unneeded: false  # within the hysteresis under the threshold, evict persistent
                             # models foresight expects no use of for 10x their reload time
    governor:
      samples: 3           # passes in a row over a threshold before climbing a step
      cooldown: 5m         # all signals clear this long before walking a step down
      vram_pressure: 95%   # used fraction of a GPU
      fragmentation: 2GiB  # torch reserved - allocated on a GPU, summed over residents
      unregistered: null   # NVML used - registered residents (memory nobody declared)
      psi_some: 20         # /proc/pressure/memory "some" avg10, %
      psi_full: 5          # ... "full" avg10, %
      swap_rate: 32MiB     # swap in + out per second
      oom_reports: 1       # OOMs reported by residents in one pass
      force_kill: false    # terminate owners that ignore a force-evict past the grace
      grace: 10s

Errors name the config file, the line and the key, like every gpulock config error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gpulock.core.config import Config
from gpulock.core.errors import known_hint
from gpulock.core.units import parse_clock, parse_duration, parse_size
from gpulock.governor.model import GovernorConfig, ScheduleWindow

T = TypeVar("T")

WATCHDOG_KEYS = ("interval", "threshold", "schedule", "min_idle", "hysteresis", "evict_unneeded")
GOVERNOR_KEYS = (
    "samples",
    "cooldown",
    "vram_pressure",
    "fragmentation",
    "unregistered",
    "psi_some",
    "psi_full",
    "swap_rate",
    "oom_reports",
    "force_kill",
    "grace",
)


def fraction(value: Any) -> float:
    """``85%``, ``0.85`` or ``85`` -> 0.85."""
    if isinstance(value, bool):
        raise ValueError(f"expected a percentage like 85%, got {value!r}")
    text = str(value).strip()
    try:
        if text.endswith("%"):
            number = float(text[:-1]) / 100
        else:
            number = float(text)
            if number > 1:
                number /= 100  # a bare "85" means 85 %
    except ValueError:
        raise ValueError(f"expected a percentage like 85%, got {value!r}") from None
    if not 0 <= number <= 1:
        raise ValueError(f"expected a percentage between 0% and 100%, got {value!r}")
    return number


def load(cfg: Config) -> GovernorConfig:
    """The governor's settings from a loaded gpulock Config; ConfigError names file:line:key."""
    base = GovernorConfig()
    w = cfg.settings_of("watchdog", WATCHDOG_KEYS) or {}
    g = cfg.settings_of("governor", GOVERNOR_KEYS) or {}

    def get(
        sec: Mapping[str, Any], sec_name: str, key: str, parse: Callable[[Any], T], default: T
    ) -> T:
        if key not in sec or sec[key] is None:
            return default
        try:
            return parse(sec[key])
        except (ValueError, TypeError) as e:
            raise cfg.error(f"{sec_name}.{key}", str(e)) from None

    def positive_int(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"expected a whole number >= 1, got {v!r}")
        return v

    def number(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
            raise ValueError(f"expected a number >= 0, got {v!r}")  # NaN fails the range too
        return float(v)

    def boolean(v: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError(f"expected true or false, got {v!r}")
        return v

    def wd(key: str, parse: Callable[[Any], T], default: T) -> T:
        return get(w, "watchdog", key, parse, default)

    def gv(key: str, parse: Callable[[Any], T], default: T) -> T:
        return get(g, "governor", key, parse, default)

    interval = wd("interval", parse_duration, base.interval_s)
    if interval <= 0:
        raise cfg.error("watchdog.interval", f"expected a duration above 0, got {interval!r}")
    return GovernorConfig(
        interval_s=interval,
        threshold=wd("threshold", fraction, base.threshold),
        schedule=_schedule(cfg, w.get("schedule")),
        min_idle_s=wd("min_idle", parse_duration, base.min_idle_s),
        hysteresis=wd("hysteresis", fraction, base.hysteresis),
        evict_unneeded=wd("evict_unneeded", boolean, base.evict_unneeded),
        samples=gv("samples", positive_int, base.samples),
        cooldown_s=gv("cooldown", parse_duration, base.cooldown_s),
        vram_pressure=gv("vram_pressure", fraction, base.vram_pressure),
        fragmentation_bytes=gv("fragmentation", parse_size, base.fragmentation_bytes),
        unregistered_bytes=gv("unregistered", parse_size, base.unregistered_bytes),
        psi_some=gv("psi_some", number, base.psi_some),
        psi_full=gv("psi_full", number, base.psi_full),
        swap_bytes_per_s=float(gv("swap_rate", parse_size, int(base.swap_bytes_per_s))),
        oom_reports=gv("oom_reports", positive_int, base.oom_reports),
        force_kill=gv("force_kill", boolean, base.force_kill),
        grace_s=gv("grace", parse_duration, base.grace_s),
    )


def _schedule(cfg: Config, raw: Any) -> tuple[ScheduleWindow, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise cfg.error("watchdog.schedule", "expected a list of {from, to, threshold} windows")
    windows = []
    for i, item in enumerate(raw):
        key = f"watchdog.schedule[{i}]"
        if not isinstance(item, Mapping):
            raise cfg.error(key, "expected {from: HH:MM, to: HH:MM, threshold: 40%}")
        for k in item:
            if k not in ("from", "to", "threshold"):
                raise cfg.error(
                    f"{key}.{k}",
                    f"unknown key {k!r}",
                    hint=known_hint(k, ("from", "to", "threshold")),
                )
        try:
            fh, fm = parse_clock(item["from"], key="from")
            th, tm = parse_clock(item["to"], key="to")
        except KeyError as e:
            raise cfg.error(key, f"missing {e.args[0]!r}") from None
        except (ValueError, TypeError) as e:
            raise cfg.error(key, str(e)) from None
        if "threshold" not in item:
            raise cfg.error(key, "missing 'threshold'")
        try:
            level = fraction(item["threshold"])
        except ValueError as e:
            raise cfg.error(f"{key}.threshold", str(e)) from None
        windows.append(ScheduleWindow(fh * 60 + fm, th * 60 + tm, level))
    return tuple(windows)
