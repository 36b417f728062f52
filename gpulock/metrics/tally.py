"""Counters and histograms folded from events (pure): ``fold(tally, event)``.

Which event feeds which metric (fields as ``gpulock.core.events`` writes them):

* ``acquire`` (gpu, name, waited_s): ``grants``, ``wait_seconds``.
* ``release`` (gpu, held_s): ``hold_seconds``.
* ``timeout`` (gpu, name): ``timeouts``.
* ``cleanup`` of a holding ticket, ``break`` (action ``removed`` of a granted ticket, or
  ``killed``): ``cut_short_holds`` with reason ``owner-gone``, ``hung`` or ``forced``.
* ``evict`` (reason, outcome, freed_bytes, tenant): ``evictions``, ``evicted_bytes``.
* ``oom`` (gpu): ``ooms``.  ``escalate`` / ``deescalate`` (level): the governor's steps.
* ``route`` (task, tier), ``call`` (task, tier, model, ok, tokens_in, tokens_out, cost_usd,
  latency_s), ``fallback`` (task, from_tier): the router's.
* ``gateway-request`` (task, tier, model, outcome, duration_s): written by ``gpulock serve``
  for each HTTP request; ``gateway_request_duration_seconds``.

Labels are bounded twice: free text (an eviction's reason) is mapped to a few words, and a
family that already has ``MAX_SERIES`` series puts new label values under ``other``, so a
crafted or runaway log cannot grow the exposition without end.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from gpulock.metrics.specs import BY_NAME

MAX_SERIES = 500  # per family
MAX_LABEL_CHARS = 64
OTHER = "other"

Key = tuple[str, ...]


@dataclass(slots=True)
class Tally:
    """Counter values and histogram buckets, by family name and label values."""

    counters: dict[str, dict[Key, float]] = field(default_factory=dict)
    # Per label set: one count per bucket (not cumulative; the last is +Inf), then the sum.
    histograms: dict[str, dict[Key, list[float]]] = field(default_factory=dict)

    def add(self, name: str, labels: Key, value: float = 1.0) -> None:
        if not _finite(value) or value < 0:
            return  # a counter only goes up, and a garbage number must not poison it
        table = self.counters.setdefault(name, {})
        key = _bounded(table, labels, BY_NAME[name].labels)
        table[key] = table.get(key, 0.0) + value

    def observe(self, name: str, labels: Key, value: float) -> None:
        if not _finite(value) or value < 0:
            return
        spec = BY_NAME[name]
        table = self.histograms.setdefault(name, {})
        key = _bounded(table, labels, spec.labels)
        row = table.get(key)
        if row is None:
            row = table[key] = [0.0] * (len(spec.buckets) + 2)
        row[bisect.bisect_left(spec.buckets, value)] += 1  # le is inclusive
        row[-1] += value

    # --- on disk ----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "counters": {n: [[list(k), v] for k, v in t.items()] for n, t in self.counters.items()},
            "histograms": {
                n: [[list(k), row] for k, row in t.items()] for n, t in self.histograms.items()
            },
        }

    @classmethod
    def from_json(cls, obj: Any) -> Tally:
        """The tally in ``obj``; damaged parts are dropped (they restart from zero)."""
        t = cls()
        if not isinstance(obj, dict):
            return t
        for name, rows in _items(obj.get("counters")):
            spec = BY_NAME.get(name)
            if spec is None or spec.kind != "counter":
                continue
            for key, v in _rows(rows, len(spec.labels)):
                if isinstance(v, int | float) and not isinstance(v, bool) and _finite(v) and v >= 0:
                    t.counters.setdefault(name, {})[key] = float(v)
        for name, rows in _items(obj.get("histograms")):
            spec = BY_NAME.get(name)
            if spec is None or spec.kind != "histogram":
                continue
            for key, row in _rows(rows, len(spec.labels)):
                if (
                    isinstance(row, list)
                    and len(row) == len(spec.buckets) + 2
                    and all(
                        isinstance(x, int | float) and not isinstance(x, bool) and _finite(x)
                        for x in row
                    )
                ):
                    t.histograms.setdefault(name, {})[key] = [float(x) for x in row]
        return t


def _items(obj: Any) -> list[tuple[str, Any]]:
    return [(str(k), v) for k, v in obj.items()] if isinstance(obj, dict) else []


def _rows(rows: Any, width: int) -> list[tuple[Key, Any]]:
    out = []
    for item in rows if isinstance(rows, list) else []:
        if (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], list)
            and len(item[0]) == width
            and all(isinstance(x, str) for x in item[0])
        ):
            out.append((tuple(item[0]), item[1]))
    return out


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except (TypeError, OverflowError):
        return False


def _bounded(table: dict[Key, Any], labels: Key, names: tuple[str, ...]) -> Key:
    key = tuple(v[:MAX_LABEL_CHARS] for v in labels)
    if key in table or len(table) < MAX_SERIES:
        return key
    # Full: keep the GPU (a handful), put the free-text labels under "other".
    return tuple(v if n == "gpu" else OTHER for n, v in zip(names, key, strict=True))


# --- reading event fields ----------------------------------------------------------------------


def _text(v: Any, default: str = "") -> str:
    if v is None or isinstance(v, dict | list):
        return default
    return str(v)


def _gpu(e: dict[str, Any]) -> str:
    g = e.get("gpu")
    return str(g) if isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1024 else ""


def _gpus(e: dict[str, Any], *keys: str) -> list[str]:
    """The GPU labels of an event: those of the first of ``keys`` that lists GPUs (a set
    ticket's ``granted``, its ``gpu_set``...), else its ``gpu`` alone (a pinned ticket)."""
    for key in keys:
        v = e.get(key)
        if isinstance(v, list) and v:
            out = [str(g) for g in v[:1024] if type(g) is int and 0 <= g < 1024]
            if out:
                return out
    return [_gpu(e)]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def eviction_reason(text: Any) -> str:
    """An eviction's free-text reason as one of a few words (a bounded label)."""
    r = _text(text)
    if r == "requested":
        return "request"
    if r.startswith("room for ticket"):
        return "make-room"
    if r.startswith("governor force-evict"):
        return "governor-force-evict"
    if r.startswith("governor evict"):
        return "governor-evict"
    if r.startswith("tenant") or r.startswith("exclusive"):
        return "tenant"
    return OTHER


def _cut_reason(text: Any) -> str:
    r = _text(text)
    if r.startswith("hung"):
        return "hung"
    if r == "forced":
        return "forced"
    return "owner-gone"


# --- the fold ----------------------------------------------------------------------------------


def fold(t: Tally, e: dict[str, Any]) -> None:
    """Count one event (a dict with a string ``event``); unknown kinds count nothing."""
    kind = e.get("event")
    handler = _FOLDS.get(kind) if isinstance(kind, str) else None
    if handler is not None:
        handler(t, e)


def _acquire(t: Tally, e: dict[str, Any]) -> None:
    waited = _num(e.get("waited_s"))
    for gpu in _gpus(e, "granted"):  # a multi-GPU grant is a grant of each GPU it holds
        t.add("gpulock_grants", (gpu, _text(e.get("name"))))
        if waited is not None:
            t.observe("gpulock_wait_seconds", (gpu,), waited)


def _release(t: Tally, e: dict[str, Any]) -> None:
    held = _num(e.get("held_s"))
    if held is not None:
        for gpu in _gpus(e, "granted"):
            t.observe("gpulock_hold_seconds", (gpu,), held)


def _timeout(t: Tally, e: dict[str, Any]) -> None:
    for gpu in _gpus(e, "gpu_set", "gpus"):  # a set ticket gave up on each GPU of its set
        t.add("gpulock_timeouts", (gpu, _text(e.get("name"))))


def _cleanup(t: Tally, e: dict[str, Any]) -> None:
    if "ticket" in e and e.get("holding") is True:
        t.add("gpulock_cut_short_holds", (_gpu(e), "owner-gone"))


def _break(t: Tally, e: dict[str, Any]) -> None:
    if e.get("action") == "killed":
        t.add("gpulock_cut_short_holds", (_gpu(e), _cut_reason(e.get("reason"))))
    elif e.get("action") == "removed" and (_num(e.get("held_s")) or 0) > 0:
        t.add("gpulock_cut_short_holds", (_gpu(e), "owner-gone"))


def _evict(t: Tally, e: dict[str, Any]) -> None:
    reason = eviction_reason(e.get("reason"))
    tenant = _text(e.get("tenant"))
    outcome = _text(e.get("outcome"), "unknown")
    t.add("gpulock_evictions", (reason, outcome, tenant))
    freed = _num(e.get("freed_bytes"))
    if freed is not None and outcome == "freed":  # only what a probe saw come back
        t.add("gpulock_evicted_bytes", (reason, tenant), freed)


def _oom(t: Tally, e: dict[str, Any]) -> None:
    t.add("gpulock_ooms", (_gpu(e),))


def _escalate(t: Tally, e: dict[str, Any]) -> None:
    t.add("gpulock_governor_escalations", (_text(e.get("level")),))


def _deescalate(t: Tally, e: dict[str, Any]) -> None:
    t.add("gpulock_governor_deescalations", (_text(e.get("level")),))


def _route(t: Tally, e: dict[str, Any]) -> None:
    t.add("gpulock_router_routes", (_text(e.get("task")), _text(e.get("tier"), "none")))


def _call(t: Tally, e: dict[str, Any]) -> None:
    task, tier, model = _text(e.get("task")), _text(e.get("tier")), _text(e.get("model"))
    outcome = "ok" if e.get("ok") is True else "error"
    t.add("gpulock_router_calls", (task, tier, model, outcome, _text(e.get("host"))))
    for field_name, metric in (
        ("tokens_in", "gpulock_router_input_tokens"),
        ("tokens_out", "gpulock_router_output_tokens"),
        ("cost_usd", "gpulock_router_cost_usd"),
    ):
        v = _num(e.get(field_name))
        if v:
            t.add(metric, (task, tier, model), v)
    latency = _num(e.get("latency_s"))
    if latency is not None:
        t.observe("gpulock_router_call_duration_seconds", (tier,), latency)


def _fallback(t: Tally, e: dict[str, Any]) -> None:
    t.add("gpulock_router_fallbacks", (_text(e.get("task")), _text(e.get("from_tier"))))


def _gateway(t: Tally, e: dict[str, Any]) -> None:
    d = _num(e.get("duration_s"))
    if d is None:
        return
    labels = (
        *tuple(_text(e.get(k)) for k in ("task", "tier", "model")),
        _text(e.get("outcome"), "unknown"),
    )
    t.observe("gpulock_gateway_request_duration_seconds", labels, d)


_FOLDS = {
    "acquire": _acquire,
    "release": _release,
    "timeout": _timeout,
    "cleanup": _cleanup,
    "break": _break,
    "evict": _evict,
    "oom": _oom,
    "escalate": _escalate,
    "deescalate": _deescalate,
    "route": _route,
    "call": _call,
    "fallback": _fallback,
    "gateway-request": _gateway,
}
KINDS = frozenset(_FOLDS)
