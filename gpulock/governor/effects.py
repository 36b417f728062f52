"""The governor's hands: carry out the policy's actions and publish its word.

``Effects.apply(actions, snapshot, config)`` does what ``gpulock.governor.policy.decide`` asked, in
order, and returns one result per action (a dict, also what ``--once --json`` would show):

* ``evict`` -- ``gpulock.residents.eviction.evict`` on the resident's current record (an idle model:
  the owner gets ``EVICT_TIMEOUT_S`` to reach a safe point and as long again to unload; if it
  became busy meanwhile it is no longer idle, and the next pass decides again).
* ``force-evict`` -- the same with ``force=True`` (pinned too) and ``grace`` to comply.  When
  the owner is busy or silent past the grace and the config says ``force_kill``, and the owner
  holds no GPU ticket (checked again right before the signal), and we may signal it: SIGTERM
  (only to a process proven to hold its claim, see ``gpulock.core.proof``), up to ``grace`` for
  its claim to go, then SIGKILL.  Each signal is a ``kill`` event, as ``gpulock break``
  writes them.
* ``level`` -- an ``escalate`` or ``deescalate`` event with the old and new level.

Events: ``eviction.evict`` already writes the ``evict`` event (outcome, freed bytes); its
``reason`` says ``governor <kind>: <why>`` in words.  The numbers that caused the action (every
signal and its threshold) go in one ``governor`` event per eviction, next to its outcome, so
``gpulock history --event governor`` answers "why was my model evicted" with the values.

``publish(level, since_wall, signals, thresholds, interval_s)`` writes ``<state>/governor.json``
atomically.  When the level leaves ``freeze`` it rings the first waiter of every GPU queue, so
waiters held back by the freeze look again at once instead of at their next timed check.

With ``dry_run`` nothing is evicted, signalled, published or logged: one line per action goes
to ``out`` instead, e.g. ``would evict qwen-7b (3f2-1) on gpu0: 11.2 GiB used > 10.2 GiB (85%)
at 14:05; idle 42m, 6.0 GiB``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from gpulock import arbiter
from gpulock.arbiter import Settings
from gpulock.core.units import format_size
from gpulock.governor.model import LEVELS, Action, GovernorConfig, Snapshot
from gpulock.governor.policy import threshold_in_force

EVICT_TIMEOUT_S = 2.0  # an idle model's owner answers at once; busy means "not idle" now


class Effects:
    """Evictions, kills, events and ``governor.json``: everything the governor changes."""

    def __init__(
        self,
        settings: Settings,
        *,
        dry_run: bool = False,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.dry_run = dry_run
        self.out = sys.stdout if out is None else out
        self.clock = clock
        self.level = "normal"  # as the level actions applied so far left it
        self.published: str | None = None  # the level last written to governor.json
        self.rung: list[tuple[int, int]] = []  # (gpu, ticket) rung when the freeze last ended

    # --- actions -----------------------------------------------------------------------------

    def apply(
        self, actions: Iterable[Action], snapshot: Snapshot, config: GovernorConfig
    ) -> list[dict[str, Any]]:
        """Carry out ``actions`` in order; one result dict per action."""
        results: list[dict[str, Any]] = []
        records: dict[str, arbiter.Record] | None = None
        for a in actions:
            if a.kind == "level":
                results.append(self._level(a))
            elif a.kind in ("evict", "force-evict"):
                if self.dry_run:
                    print(describe(a, snapshot, config), file=self.out, flush=True)
                    results.append(_result(a, "dry-run", "nothing done"))
                    continue
                if records is None:  # read once per pass, after the level changes
                    records = {r.id: r for r in arbiter.residents(self.settings)[1]}
                results.append(self._evict(a, records.get(a.resident or ""), config))
            else:
                results.append(_result(a, "skipped", f"unknown action kind {a.kind!r}"))
        return results

    def _level(self, a: Action) -> dict[str, Any]:
        old, new = self.level, a.level or self.level
        self.level = new
        up = _rank(new) > _rank(old)
        if self.dry_run:
            verb = "escalate" if up else "deescalate"
            print(f"would {verb} {old} -> {new}: {a.reason}", file=self.out, flush=True)
            return {"action": "level", "from": old, "to": new, "outcome": "dry-run"}
        self.settings.emit(
            "escalate" if up else "deescalate",
            level=new,
            from_level=old,
            reason=a.reason,
            evidence=a.evidence,
        )
        return {"action": "level", "from": old, "to": new, "outcome": "done", "reason": a.reason}

    def _evict(
        self, a: Action, record: arbiter.Record | None, config: GovernorConfig
    ) -> dict[str, Any]:
        if record is None:
            res = _result(a, "gone", "no such resident any more (unloaded or its owner exited)")
            self._governor_event(a, res)
            return res
        force = a.kind == "force-evict"
        # The owner has the timeout to reach a safe point, and as long again to unload before
        # it counts as silent: under a force-evict, "past the grace" should not mean minutes.
        timeout_s = config.grace_s if force else min(EVICT_TIMEOUT_S, config.grace_s)
        er = arbiter.evict(
            self.settings,
            record,
            force=force,
            timeout_s=timeout_s,
            answer_s=max(2 * timeout_s, 1.0),
            reason=f"governor {a.kind}: {a.reason}",
        )
        res = _result(a, er.outcome, er.detail)
        if er.pid is not None:  # a tenant's server may have no known pid: none, not 0
            res["pid"] = er.pid
        res.update(freed_bytes=er.freed_bytes, elapsed_s=er.elapsed_s)
        if force and er.outcome in ("busy", "no-answer") and record.tenant is None:
            res["kill"] = self._kill(a, record, config, er.outcome)
        self._governor_event(a, res)
        return res

    def _kill(
        self, a: Action, r: arbiter.Record, config: GovernorConfig, why: str
    ) -> dict[str, Any]:
        """SIGTERM, grace, SIGKILL for an owner that ignored a force-evict; what happened."""
        if not config.force_kill:
            return {"outcome": "not-killed", "detail": "force_kill is off"}
        if not arbiter.may_signal(r.uid):
            return {"outcome": "not-killed", "detail": f"not permitted: owner uid {r.uid}"}
        if r.pid in arbiter.holder_pids(self.settings):
            return {"outcome": "not-killed", "detail": "its process holds a GPU ticket"}
        fd = arbiter.watch_owner(self.settings, r)
        if fd is None:
            arbiter.clean_dead(self.settings)  # cleans its records
            return {"outcome": "owner-gone", "detail": "the owner exited meanwhile"}
        evidence = {
            "resident": r.id,
            "name": r.name,
            "gpu": r.gpu,
            "pid": r.pid,
            "user": r.user,
            "reason": f"governor force-evict: {a.reason}; owner {why} after {config.grace_s:g} s",
            "evidence": a.evidence,
        }
        start = time.monotonic()
        fifo = arbiter.owner_claim(self.settings, r)
        if not arbiter.proven(r.pid, r.start_ticks, r.uid, fifo):
            # A record names its owner; only the kernel's open files prove it (any member of
            # a shared folder can write a record naming any process).
            os.close(fd)
            return {"outcome": "not-killed", "detail": f"pid {r.pid} does not hold the claim"}

        def send(sig: int) -> bool:
            return arbiter.signal_proven(r.pid, r.start_ticks, r.uid, r.pidns, fifo, sig)

        def announce(sig_name: str) -> None:
            extra = {"grace_s": config.grace_s} if sig_name == "SIGTERM" else {}
            self.settings.emit("kill", **evidence, signal=sig_name, **extra)

        try:
            outcome = arbiter.end_owner(fd, send, config.grace_s, announce)
        finally:
            os.close(fd)
        if outcome == "not-sent":
            return {"outcome": "not-killed", "detail": "pid is no longer the owner"}
        arbiter.clean_dead(self.settings)  # a dead owner's records go (a `cleanup` event each)
        elapsed = round(time.monotonic() - start, 6)
        return {"outcome": outcome, "detail": f"pid {r.pid}", "elapsed_s": elapsed}

    def _governor_event(self, a: Action, res: dict[str, Any]) -> None:
        fields = {k: v for k, v in res.items() if k != "action"}
        self.settings.emit("governor", action=a.kind, level=self.level, **fields)

    # --- the published word ------------------------------------------------------------------

    def publish(
        self,
        level_name: str,
        since_wall: float,
        signals: dict[str, Any],
        thresholds: dict[str, Any],
        interval_s: float,
        *,
        now_wall: float | None = None,
        memory: dict[str, Any] | None = None,
    ) -> arbiter.Published | None:
        """Write ``governor.json``; ring frozen waiters when the level leaves ``freeze``."""
        if self.dry_run:
            return None
        pub = arbiter.Published(
            level=level_name,
            since_wall=since_wall,
            updated_wall=self.clock() if now_wall is None else now_wall,
            interval_s=interval_s,
            pid=os.getpid(),
            signals=signals,
            thresholds=thresholds,
            memory=memory or {},
        )
        arbiter.publish_level(self.settings, pub)
        previous, self.published = self.published, level_name
        if previous == "freeze" and level_name != "freeze":
            self.rung = self.ring_waiters()
        return pub

    def ring_waiters(self) -> list[tuple[int, int]]:
        """Ring the first waiting ticket of every GPU queue; the (gpu, ticket) rung."""
        rung = []
        for gpu in arbiter.queue_gpus(self.settings):
            seq = arbiter.ring_head(self.settings, gpu)
            if seq is not None:
                rung.append((gpu, seq))
        return rung


def _rank(name: str) -> int:
    return LEVELS.index(name) if name in LEVELS else 0


def _result(a: Action, outcome: str, detail: str) -> dict[str, Any]:
    return {
        "action": a.kind,
        "resident": a.resident,
        "name": a.name,
        "gpu": a.gpu,
        "bytes": a.bytes,
        "reason": a.reason,
        "outcome": outcome,
        "detail": detail,
        "evidence": a.evidence,
    }


# --- dry-run text ----------------------------------------------------------------------------


def describe(a: Action, snapshot: Snapshot, config: GovernorConfig) -> str:
    """One line saying what an eviction would do and why, with the numbers."""
    who = f"{a.name} ({a.resident})" if a.name else str(a.resident)
    clock = f"{snapshot.local_minutes // 60:02d}:{snapshot.local_minutes % 60:02d}"
    gpu = next((g for g in snapshot.gpus if g.index == a.gpu), None)
    limit = threshold_in_force(config, snapshot.local_minutes)
    total = gpu.total_bytes if gpu is not None else None
    used = gpu.used_bytes if gpu is not None else None
    if total and used is not None and used > limit * total:
        limit_bytes = format_size(int(limit * total))
        why = f"{format_size(used)} used > {limit_bytes} ({limit * 100:.0f}%)"
    else:
        why = a.reason
    view = next((r for r in snapshot.residents if r.id == a.resident), None)
    about = []
    if view is not None:
        idle_s = snapshot.now_wall - view.last_used_wall
        about.append("in use" if view.in_use else f"idle {_ago(idle_s)}")
    about.append(format_size(a.bytes))
    verb = "force-evict" if a.kind == "force-evict" else "evict"
    kill = ""
    if a.kind == "force-evict" and config.force_kill:
        kill = f"; SIGTERM, then SIGKILL, if it ignores it for {config.grace_s:g} s"
    return f"would {verb} {who} on gpu{a.gpu}: {why} at {clock}; {', '.join(about)}{kill}"


def _ago(seconds: float) -> str:
    """``42m``, ``3h05m``, ``12s``, ``2d04h``: an idle time at a glance."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
