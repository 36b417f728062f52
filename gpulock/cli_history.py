"""``gpulock history``: the event log, filtered, as aligned lines or JSON.

``history_lines`` lays events out in columns as wide as the widest value shown, a multi-GPU
ticket under all its GPUs, and every other field as a readable ``key=value`` (sizes and
durations in units, a mapping as ``key.sub=value``), never a Python repr.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from gpulock.cli_kit import EX_OK, UsageError, check_gpu, parse_since, settings_of
from gpulock.core.errors import known_hint
from gpulock.core.units import format_duration, format_gpus, format_size


def cmd_history(args: argparse.Namespace) -> int:
    from gpulock.core import events

    since = parse_since(args.since, time.time()) if args.since else None
    settings = settings_of(args, create=False)
    kinds = set(args.event or ())
    logged = list(events.read(settings.state_dir, since_wall=since))
    known = set(events.KINDS) | {e["event"] for e in logged}  # a plugin's kinds too
    for kind in sorted(kinds - known):
        raise UsageError(
            f"--event: no event kind {kind!r}", hint=known_hint(kind, sorted(known), "kinds")
        )
    if args.gpu is not None and all(args.gpu not in _gpus_of(e) for e in logged):
        check_gpu(settings, args.gpu)  # a GPU of the past may be asked about, a typo not
    selected = [
        e
        for e in logged
        if (args.gpu is None or args.gpu in _gpus_of(e)) and (not kinds or e["event"] in kinds)
    ]
    if args.limit is not None:
        selected = selected[-args.limit :] if args.limit > 0 else []
    if args.json:
        print(json.dumps({"events": selected}, indent=2))
        return EX_OK
    for line in history_lines(selected):
        print(line)
    return EX_OK


_SHOWN = {"ts", "event", "gpu", "ticket", "pid", "name", "granted", "gpu_set"}


def _gpus_of(e: dict[str, Any]) -> tuple[int, ...]:
    """The GPUs an event is about: a multi-GPU holder's all, a set ticket's set, else its
    ``gpu`` (none for an event of no GPU)."""
    for key in ("granted", "gpu_set", "gpus"):
        v = e.get(key)
        if isinstance(v, list) and v and all(isinstance(g, int) for g in v):
            return tuple(v)
    return (e["gpu"],) if isinstance(e.get("gpu"), int) else ()


def _gpu_cell(e: dict[str, Any]) -> str:
    """history's GPU column: ``gpu0``; ``gpus 0,2`` for a multi-GPU holder or a set ticket."""
    gpus = _gpus_of(e)
    return format_gpus(gpus) if gpus else "-"


_WHO_MAX = 32  # a longer name shifts its own line's details, not every column


def history_lines(selected: Sequence[dict[str, Any]]) -> list[str]:
    """``gpulock history``'s lines, columns as wide as the widest value shown (an event kind
    like ``gateway-request`` does not push its line's columns out of step)."""
    rows = [_history_row(e) for e in selected]
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(1, 4)]
    who_w = min(max(len(r[4]) for r in rows), _WHO_MAX)
    out = []
    for stamp, kind, gpu, ticket, who, details in rows:
        line = f"{stamp}  {kind:<{widths[0]}}  {gpu:<{widths[1]}}  {ticket:>{widths[2]}}  "
        out.append((line + f"{who:<{who_w}}  {details}").rstrip())
    return out


def _history_row(e: dict[str, Any]) -> tuple[str, str, str, str, str, str]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"]))
    gpu = _gpu_cell(e)
    ticket = str(e["ticket"]) if e.get("ticket") is not None else "-"
    # Agents' and the fleet's events name their agent; the lock's name their holder.
    label_key = "name" if "name" in e else "agent"
    who = f"{e.get(label_key, '')}[{e.get('pid', '')}]" if "pid" in e else ""
    if not who and isinstance(e.get("name"), str):
        who = e["name"]  # no pid to show (a tenant's model): the name all the same
    details: list[str] = []
    for k, v in e.items():
        # Nothing to say (None, ""): a refused request has no task, tier or model.
        if k in _SHOWN or v is None or v == "" or (who and k == label_key):
            continue
        _details(details, k, v, 0)
    return stamp, str(e["event"]), gpu, ticket, who, " ".join(details)


def _details(out: list[str], key: str, v: Any, depth: int) -> None:
    """``key=value`` for history, readably: a mapping as ``key.sub=value`` (a governor's
    ``evidence``, a route's ``model``), a list of plain values comma-joined, sizes and
    durations in units; never a Python repr."""
    if isinstance(v, dict) and depth < 4:
        for sub, sv in v.items():
            if sv is not None and sv != "":
                _details(out, f"{key}.{sub}", sv, depth + 1)
        return
    out.append(f"{key}={_value(key, v)}")


def _value(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if key.endswith("_s") and isinstance(v, int | float):
        return format_duration(v)
    if key.endswith("_bytes") and isinstance(v, int):
        return format_size(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, int | str):
        return str(v)
    if isinstance(v, list) and all(isinstance(x, int | float | str) for x in v):
        return ",".join(_value(key, x) for x in v) or "[]"
    return json.dumps(v, separators=(",", ":"), default=str)
