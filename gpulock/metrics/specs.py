"""Every metric gpulock exports, in one table: name, type, help, labels, histogram buckets.

The names follow Prometheus' conventions: a ``gpulock_`` prefix, base units in the name
(``_seconds``, ``_bytes``; money is ``_usd``, there being no base unit for it), ``_total`` on
counters (written here without it: the exposition adds it), and only bounded labels (gpu, tier,
task, model, owner, tenant, reason, outcome, level, signal, policy) - never a pid or a ticket
number, which would make a new series per job.

Counters and histograms are folded from the event log (``gpulock.metrics.tally``); gauges are
read from the state at scrape time (``gpulock.metrics.families``).  The dashboard test checks
``gpulock/share/grafana-dashboard.json`` (``gpulock files grafana``) against ``names()``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Waits and holds last from milliseconds (an idle GPU) to hours (a nightly batch).
TIME_BUCKETS_S = (0.01, 0.1, 0.5, 1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400)
# Model calls and gateway requests: tens of milliseconds to a few minutes.
CALL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True, slots=True)
class Spec:
    name: str  # without the _total of counters
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _c(name: str, help: str, *labels: str) -> Spec:
    return Spec(f"gpulock_{name}", "counter", help, labels)


def _g(name: str, help: str, *labels: str) -> Spec:
    return Spec(f"gpulock_{name}", "gauge", help, labels)


def _h(name: str, help: str, buckets: tuple[float, ...], *labels: str) -> Spec:
    return Spec(f"gpulock_{name}", "histogram", help, labels, buckets)


# --- from the event log (monotonic across restarts: the tally is persisted) -------------------

COUNTERS = (
    _c(
        "grants",
        "GPU grants (acquire events) by GPU and holder name; a multi-GPU grant on each GPU",
        "gpu",
        "owner",
    ),
    _c(
        "timeouts",
        "waits that gave up past their --timeout, by GPU and name; a set's on each of its GPUs",
        "gpu",
        "owner",
    ),
    _c(
        "cut_short_holds",
        "holds that ended other than by a release: owner-gone, hung (killed past its lease), "
        "forced (gpulock break --force)",
        "gpu",
        "reason",
    ),
    _c(
        "evictions",
        "eviction requests by why (request, make-room, governor-evict, governor-force-evict, "
        "tenant, other) and how they ended (freed, unloaded, refused, busy, no-answer, ...)",
        "reason",
        "outcome",
        "tenant",
    ),
    _c("evicted_bytes", "bytes freed by evictions, by reason", "reason", "tenant"),
    _c("ooms", "out-of-memory errors reported by residents and the router, by GPU", "gpu"),
    _c("governor_escalations", "governor steps up the ladder, by the level reached", "level"),
    _c("governor_deescalations", "governor steps down the ladder, by the level reached", "level"),
    _c("router_routes", "routing decisions by task and the tier chosen (none)", "task", "tier"),
    _c(
        "router_calls",
        "model calls by task, tier, model, outcome and the cluster host that ran them",
        "task",
        "tier",
        "model",
        "outcome",
        "host",  # bounded: the hosts of a cluster ("" without one)
    ),
    _c("router_input_tokens", "prompt tokens of model calls", "task", "tier", "model"),
    _c("router_output_tokens", "completion tokens of model calls", "task", "tier", "model"),
    _c(
        "router_cost_usd",
        "what model calls cost (USD, from the route's price)",
        "task",
        "tier",
        "model",
    ),
    _c(
        "router_fallbacks",
        "calls moved to another candidate after a failure, by the tier that failed",
        "task",
        "tier",
    ),
    _c("event_log_lines", "event-log lines the exporter has read"),
    _c("event_log_garbage_lines", "event-log lines skipped as unreadable"),
)

HISTOGRAMS = (
    _h("wait_seconds", "time in line before a grant", TIME_BUCKETS_S, "gpu"),
    _h("hold_seconds", "time a holder held the GPU, at its release", TIME_BUCKETS_S, "gpu"),
    _h("router_call_duration_seconds", "model call latency", CALL_BUCKETS_S, "tier"),
    _h(
        "gateway_request_duration_seconds",
        "HTTP requests to gpulock serve (gateway-request events), by task, tier, model and outcome",
        CALL_BUCKETS_S,
        "task",
        "tier",
        "model",
        "outcome",
    ),
)

# --- from the state at scrape time ---------------------------------------------------------------

GAUGES = (
    _g("queue_holders", "tickets holding the GPU now (hung ones included)", "gpu"),
    _g("queue_waiters", "tickets waiting in line now", "gpu"),
    _g("queue_stale", "dead or hung tickets awaiting gpulock break", "gpu"),
    _g("queue_oldest_wait_seconds", "how long the head waiter has waited (0: nobody waits)", "gpu"),
    _g(
        "queue_claimed_bytes",
        "VRAM claimed by holders' --need, by GPU and holder name",
        "gpu",
        "owner",
    ),
    _g("gpu_memory_total_bytes", "GPU memory", "gpu"),
    _g(
        "gpu_memory_used_bytes",
        "GPU memory in use (NVML, or what is declared when simulated)",
        "gpu",
    ),
    _g("gpu_memory_free_bytes", "GPU memory free", "gpu"),
    _g(
        "gpu_memory_reserved_bytes", "GPU memory kept out of --need sharing (config reserve)", "gpu"
    ),
    _g("gpu_memory_claimed_bytes", "GPU memory claimed by holders' --need", "gpu"),
    _g(
        "resident_bytes",
        "VRAM of resident models (measured, else declared) by model, owner (user) and tenant",
        "gpu",
        "model",
        "owner",
        "tenant",
        "policy",
    ),
    _g("resident_models", "resident models", "gpu", "tenant"),
    _g("resident_in_use", "resident models inside a call now", "gpu", "tenant"),
    _g("governor_up", "1 while a live governor's level counts, else 0"),
    _g("governor_level", "1 for the level in force, 0 for the others", "level"),
    _g(
        "governor_level_index",
        "the level in force as a number: 0 normal, 1 reduce, 2 evict-idle, 3 force-evict, 4 freeze",
    ),
    _g(
        "governor_signal",
        "the last pass's signals (ratios, bytes, bytes/s, PSI %, counts)",
        "signal",
        "gpu",
    ),
    _g("governor_threshold", "the thresholds in force, named as the signals they bound", "signal"),
    _g("governor_last_pass_timestamp_seconds", "when the governor last published"),
    _g("router_cloud_spend_today_usd", "cloud spend so far today (local day; UTC in a cluster)"),
    _g("router_daily_budget_usd", "router.daily_budget (absent when unset)"),
    _g(
        "cluster_hosts",
        "live hosts of the cluster, as this host last saw them (no cluster: absent)",
    ),
    _g(
        "cluster_redis_up",
        "1 while the cluster's Redis answers this host, else 0 (no cluster: absent)",
    ),
)

ALL = COUNTERS + HISTOGRAMS + GAUGES
BY_NAME = {s.name: s for s in ALL}


def names() -> set[str]:
    """Every sample name the exporter can produce (``_total``, ``_bucket``... included)."""
    out: set[str] = set()
    for s in ALL:
        if s.kind == "counter":
            out |= {s.name + "_total"}
        elif s.kind == "histogram":
            out |= {s.name + "_bucket", s.name + "_sum", s.name + "_count"}
        else:
            out.add(s.name)
    return out
