"""What one governor pass saw and decided, for people (``--once --dry-run``) and scripts
(``--once --json``): the signals against their thresholds, the level, the actions.

Pure: built from the pass's snapshot, the config and the results ``Effects.apply`` returned,
so a dry run that decides nothing still says why ("gpu0: 5.0 GiB used of 12.0 GiB (42%),
threshold 50%").
"""

from __future__ import annotations

from typing import Any

from gpulock.core.units import format_size
from gpulock.governor.daemon import signals_of, thresholds_of
from gpulock.governor.model import GovernorConfig, Snapshot


def decision(
    snapshot: Snapshot,
    config: GovernorConfig,
    level_before: str,
    level_after: str,
    results: list[dict[str, Any]],
) -> dict[str, Any]:
    """The pass as one JSON-able object: ``level``, ``level_before``, ``signals``,
    ``thresholds`` (as ``governor.json`` publishes them) and ``actions``."""
    return {
        "level": level_after,
        "level_before": level_before,
        "signals": signals_of(snapshot),
        "thresholds": thresholds_of(config, snapshot),
        "actions": results,
    }


def lines(d: dict[str, Any]) -> list[str]:
    """The decision in a few lines: the level, one line per GPU, one for the host."""
    before, after = d["level_before"], d["level"]
    out = [f"level: {after}" + (" (unchanged)" if before == after else f" (was {before})")]
    sig, th = d["signals"], d["thresholds"]
    threshold = th.get("threshold")
    for g in sig["gpus"]:
        used, total, frac = g["used_bytes"], g["total_bytes"], g["used_fraction"]
        if used is None:
            measured = "used memory unknown"
        else:
            of = f" of {format_size(total)}" if total else ""
            pct = f" ({frac:.0%})" if frac is not None else ""
            measured = f"{format_size(used)} used{of}{pct}"
        limit = f", threshold {threshold:.0%}" if isinstance(threshold, float) else ""
        out.append(f"gpu{g['index']}: {measured}{limit}; {g['residents']} resident model(s)")
    if not sig["gpus"]:
        out.append("gpus: none measured")
    out.append(
        "host: memory pressure "
        f"some {_num(sig['psi_some_avg10'])}% (limit {_num(th['psi_some'])}%), "
        f"full {_num(sig['psi_full_avg10'])}% (limit {_num(th['psi_full'])}%); swap "
        f"{_rate(sig['swap_bytes_per_s'])} (limit {_rate(th['swap_bytes_per_s'])}); "
        f"OOM reports {sig['oom_reports']}, kernel OOM kills {_num(sig['oom_kills'])}"
    )
    n = len(d["actions"])
    out.append("actions: none" if n == 0 else f"actions: {n}")
    return out


def _num(v: Any) -> str:
    if v is None:
        return "unknown"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _rate(v: Any) -> str:
    return "unknown" if v is None else f"{format_size(int(v))}/s"
