"""``gpulock replay``'s simulator: one GPU (or a host of several), a day of arrivals, one
eviction policy.  Pure.

The rules are the live system's own code, not a second copy: who may hold the GPU is
``gpulock.lock.queue.decide`` on real ``Ticket`` records (FIFO, ``need`` sharing within the
budget left by the reserve, exclusive jobs), and victims are ordered by
``gpulock.core.foresight.order``, the function ``gpulock.residents.eviction`` and the governor
call.  What the simulator adds is the world: a clock, model files that take time to load, and
the memory they hold between jobs.

* An arrival (``Arrival``) joins the line at ``time_s``; when ``decide`` grants it, room is made
  as ``make_room`` makes it (idle models leave in victim order until its model fits beside the
  others' models and every holder's working memory, its own included; an exclusive grant
  clears every idle model but its own, as ``exclusive_clears_residents`` does), its model
  loads if it is not resident (``model_bytes / load_bytes_per_s``, or the model's measured
  load time), then it holds the GPU for ``hold_s``.  Its model stays resident after.
* Memory is the GPU less its ``reserve``, for models and work alike.  An arrival whose model or
  ``need`` cannot fit that (``fits``) is left out and counted (``Row.unfit``): a replay plans
  hardware, so it never plays a job as if it fitted.
* ``wait_s`` of an arrival: from joining the line to the start of its work (its own load
  included: that is the time a model swap costs the agent).  A ``deadline_s`` missed counts.
* Policies: ``lru`` (least recently used first: today's order), ``keepalive`` (Ollama's: an idle
  model unloads after ``keepalive_s``; room by LRU), ``foresight`` (next use from what the
  simulated machine knows at that moment: the arrivals' past and the line; weighted by reload
  cost), ``belady`` (a next-use oracle: the whole trace's true next use, sizes and cost
  ignored: the offline optimum only when every model has one size and one reload cost; the
  cost-aware bound is ``gpulock.replay_bound``).
* Who waited behind whom (``Row.pairs``): for every job that waited in line, the other agents
  that were in the line (holding or waiting) when it joined.
* A host of several GPUs (``gpus=2``: ``--gpu 2x24GiB``): every arrival asks for its count of
  GPUs (``Arrival.gpus``, 1 unless it held several) from all of them, as ``--gpu any`` does,
  decided by ``gpulock.lock.queue.decide_set`` (the set rule, with its preference for a GPU
  where the job's model is resident, then the most free memory); each GPU has its own models
  and is made room on as one GPU is.  A model split over k GPUs (a job of ``gpus=k``) holds a
  k-th of its bytes on each, and is another model than the same file on one GPU.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from gpulock.core import foresight as fs
from gpulock.lock.queue import decide, decide_set
from gpulock.lock.ticket import Ticket

POLICIES: Final = ("lru", "keepalive", "foresight", "belady")
LOAD_BYTES_PER_S: Final = float(fs.DISK_BYTES_PER_S)
KEEPALIVE_S: Final = 300.0  # Ollama's default keep_alive
HISTORY_PER_USER: Final = 64  # uses foresight is shown per (model, agent): the live log is bounded


@dataclass(frozen=True, slots=True)
class Arrival:
    """One ticket of the trace: at ``time_s`` (seconds from the start), ``name`` asks for the GPU
    for ``hold_s`` with ``need_bytes`` (None: exclusive) and ``model`` (``""``: none)."""

    time_s: float
    name: str
    model: str
    model_bytes: int
    hold_s: float
    need_bytes: int | None
    deadline_s: float | None = None  # the longest it would wait (its lock timeout)
    gpus: int = 1  # GPUs at once (a job that held several, --gpus N): need_bytes on each


def model_key(a: Arrival) -> str:
    """The resident model an arrival uses: its file, or the file split over its GPUs."""
    return a.model if a.gpus == 1 else f"{a.model} (split over {a.gpus})"


@dataclass(frozen=True, slots=True)
class Pair:
    """Two agents that stood in each other's way: how many times one joined the line behind
    the other and waited, and the seconds those waits added up to."""

    a: str
    b: str
    times: int
    waited_s: float


@dataclass(frozen=True, slots=True)
class Row:
    """One (GPU size, policy) result: the ``--json`` row.  The bound's row (``policy``
    "bound", ``gpulock.replay_bound``) has no waits, misses nor evictions (None)."""

    gpu_bytes: int
    policy: str
    loads: int
    loaded_bytes: int
    load_s: float
    wait_s_total: float | None
    wait_s_p90: float | None
    deadline_misses: int | None
    evictions: int | None
    unfit: int = 0  # jobs whose model or need cannot fit this GPU (less the reserve): left out
    pairs: tuple[Pair, ...] = ()  # who waited behind whom, most waited first (not in --json)
    gpus: int = 1  # GPUs of the host, each of gpu_bytes

    @property
    def host(self) -> tuple[int, int]:
        """What the row replayed: (GPUs of the host, each GPU's bytes)."""
        return (self.gpus, self.gpu_bytes)

    def as_dict(self) -> dict[str, object]:
        return {
            "gpu_bytes": self.gpu_bytes,
            "gpus": self.gpus,
            "policy": self.policy,
            "unfit": self.unfit,
            "loads": self.loads,
            "loaded_bytes": self.loaded_bytes,
            "load_s": round(self.load_s, 3),
            "wait_s_total": _r3(self.wait_s_total),
            "wait_s_p90": _r3(self.wait_s_p90),
            "deadline_misses": self.deadline_misses,
            "evictions": self.evictions,
        }


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def fits(a: Arrival, budget_bytes: int, gpus: int = 1) -> bool:
    """Whether ``a``'s model and its ``need`` fit a GPU whose memory to hand out (its size less
    the reserve) is ``budget_bytes``, and a host of ``gpus`` has the GPUs it takes at once."""
    share = a.model_bytes // max(a.gpus, 1)
    return a.gpus <= gpus and share <= budget_bytes and (a.need_bytes or 0) <= budget_bytes


def unfit(arrivals: Sequence[Arrival], budget_bytes: int, gpus: int = 1) -> list[Arrival]:
    """The arrivals that cannot fit (``fits``): a replay leaves them out and counts them."""
    return [a for a in arrivals if not fits(a, budget_bytes, gpus)]


@dataclass(slots=True)
class _Model:
    bytes: int
    last_used_s: float
    users: int = 0  # holders using it now: never a victim


@dataclass(slots=True)
class _Sim:
    arrivals: Sequence[Arrival]
    gpu_bytes: int
    budget_bytes: int
    policy: str
    load_s_of: dict[str, float]
    keepalive_s: float
    now: float = 0.0
    seq: int = 0
    line: list[tuple[Ticket, Arrival]] = field(default_factory=list)  # tickets in seq order
    ends: list[tuple[float, int]] = field(default_factory=list)  # heap: (end time, seq)
    n_gpus: int = 1
    residents: list[dict[str, _Model]] = field(default_factory=list)  # per GPU
    history: dict[str, dict[str, deque[float]]] = field(default_factory=dict)  # model, agent
    future: dict[str, deque[float]] = field(default_factory=dict)  # belady: arrival times
    loads: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    misses: int = 0
    evictions: int = 0
    behind: dict[int, list[str]] = field(default_factory=dict)  # seq -> names ahead on arrival
    pairs: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # -> [times, s]

    # -- the loop --

    def run(self) -> Row:
        i = 0
        self.residents = [{} for _ in range(self.n_gpus)]
        todo = sorted(self.arrivals, key=lambda a: a.time_s)
        if self.policy == "belady":
            for a in todo:
                if a.model:
                    self.future.setdefault(model_key(a), deque()).append(a.time_s)
        while i < len(todo) or self.line:
            next_arrival = todo[i].time_s if i < len(todo) else math.inf
            next_end = self.ends[0][0] if self.ends else math.inf
            if next_arrival == math.inf and next_end == math.inf:
                break  # nothing holds and nobody can be granted: cannot happen with decide
            if next_end <= next_arrival:
                self.now = next_end
                self._expire()
                _, seq = heapq.heappop(self.ends)
                self._release(seq)
            else:
                self.now = next_arrival
                self._expire()
                a = todo[i]
                i += 1
                self.seq += 1
                every = tuple(range(self.n_gpus)) if self.n_gpus > 1 else ()
                t = Ticket(
                    self.seq, 0, self.seq, 0, "replay", "replay", a.name, a.time_s,
                    need_bytes=a.need_bytes, gpus=every, count=a.gpus,
                )  # fmt: skip
                self.behind[t.seq] = [x.name for _, x in self.line]
                self.line.append((t, a))
            self._grant_all()
        waits = sorted(self.waits)
        p90 = waits[min(len(waits) - 1, math.ceil(0.9 * len(waits)) - 1)] if waits else 0.0
        pairs = sorted(
            (Pair(a, b, int(n), s) for (a, b), (n, s) in self.pairs.items()),
            key=lambda p: (-p.waited_s, -p.times, p.a, p.b),
        )
        return Row(
            self.gpu_bytes, self.policy, self.loads, self.loaded_bytes, self.load_s,
            sum(waits), p90, self.misses, self.evictions, pairs=tuple(pairs), gpus=self.n_gpus,
        )  # fmt: skip

    def _grant_all(self) -> None:
        """Every waiter the lock's rule lets in, in line order (a grant may let the next one
        share; on a host of several GPUs, a later ticket may take a GPU no earlier one waits
        for)."""
        if self.n_gpus > 1:
            while self._grant_one():
                pass
            return
        changed = True
        while changed:
            changed = False
            for k, (t, a) in enumerate(self.line):
                if t.holding:
                    continue
                ahead = [x for x, _ in self.line[:k]]
                if decide(t, ahead, self.budget_bytes).grant:
                    self.line[k] = (t.granted(self.now), a)
                    self._start(t, a, exclusive=t.exclusive)
                    changed = True
                break  # FIFO: nobody behind a waiter is looked at

    def _grant_one(self) -> bool:
        """Several GPUs: the first waiter ``decide_set`` grants, granted; whether one was."""
        budgets: dict[int, int | None] = dict.fromkeys(range(self.n_gpus), self.budget_bytes)
        for k, (t, a) in enumerate(self.line):
            if t.holding:
                continue
            lines = {
                g: [x for x, _ in self.line[:k] if g in (x.held_gpus or x.gpu_set)]
                for g in range(self.n_gpus)
            }
            key = model_key(a)
            warm = {
                g: "resident" for g in range(self.n_gpus) if a.model and key in self.residents[g]
            }
            free: dict[int, int | None] = {g: self._free_bytes(g) for g in range(self.n_gpus)}
            d = decide_set(t, lines, budgets, warm=warm, free=free)
            if d.grant:
                held = replace(t.granted(self.now), gpu=d.grant[0], granted_gpus=d.grant)
                self.line[k] = (held, a)
                self._start(held, a, exclusive=t.exclusive, gpus=d.grant)
                return True
        return False

    def _start(
        self, t: Ticket, a: Arrival, *, exclusive: bool, gpus: tuple[int, ...] = (0,)
    ) -> None:
        load = 0.0
        if a.model:
            key = model_key(a)
            share = a.model_bytes // a.gpus
            missing = [g for g in gpus if key not in self.residents[g]]
            for g in gpus:
                if exclusive:
                    self._evict_all(keep=key, gpu=g)
                # Its working memory (``need`` beyond the model) is counted already: it holds
                # the GPU (``_free_bytes``); what must fit beside the others is its model, if
                # not loaded.
                self._make_room(share if g in missing else 0, keep=key, gpu=g)
            if missing:
                load = self.load_s_of.get(a.model, a.model_bytes / LOAD_BYTES_PER_S)
                self.loads += 1
                self.loaded_bytes += a.model_bytes
                self.load_s += load
                for g in missing:
                    self.residents[g][key] = _Model(share, self.now)
            for g in gpus:
                m = self.residents[g][key]
                m.users += 1
                m.last_used_s = self.now
            if self.policy == "belady":  # FIFO: this is the model's earliest unstarted arrival
                self.future[key].popleft()
            mine = self.history.setdefault(key, {})
            mine.setdefault(a.name, deque(maxlen=HISTORY_PER_USER)).append(self.now)
        elif exclusive:
            for g in gpus:
                self._evict_all(keep="", gpu=g)
        wait = self.now + load - a.time_s
        self.waits.append(wait)
        queued = self.now - a.time_s
        if queued > 0:  # it waited in line: behind whom?
            for other in set(self.behind.pop(t.seq, ())) - {a.name}:
                pair = self.pairs.setdefault((min(a.name, other), max(a.name, other)), [0, 0.0])
                pair[0] += 1
                pair[1] += queued
        else:
            self.behind.pop(t.seq, None)
        if a.deadline_s is not None and self.now - a.time_s > a.deadline_s:
            self.misses += 1
        heapq.heappush(self.ends, (self.now + load + a.hold_s, t.seq))

    def _release(self, seq: int) -> None:
        k = next(k for k, (t, _) in enumerate(self.line) if t.seq == seq)
        t, a = self.line.pop(k)
        for g in t.held_gpus or (0,):
            m = self.residents[g].get(model_key(a)) if a.model else None
            if m is not None:
                m.users -= 1
                m.last_used_s = self.now

    # -- eviction: the live system's order --

    def _free_bytes(self, gpu: int = 0) -> int:
        """What is left to hand out on ``gpu``: the GPU less its reserve, its models and its
        holders' working memory (the reserve is never handed out, to models neither)."""
        models = sum(m.bytes for m in self.residents[gpu].values())
        work = sum(
            max((a.need_bytes or 0) - a.model_bytes // a.gpus, 0)
            for t, a in self.line
            if t.holding and gpu in (t.held_gpus or (0,))
        )
        return self.budget_bytes - models - work

    def _make_room(self, need_bytes: int, *, keep: str, gpu: int = 0) -> None:
        short = need_bytes - self._free_bytes(gpu)
        if short <= 0:
            return
        for name in self._victims(keep, room_bytes=short, gpu=gpu):
            if short <= 0:
                break
            short -= self.residents[gpu].pop(name).bytes
            self.evictions += 1

    def _evict_all(self, keep: str, gpu: int = 0) -> None:
        for name in self._victims(keep, gpu=gpu):
            del self.residents[gpu][name]
            self.evictions += 1

    def _expire(self) -> None:
        if self.policy != "keepalive":
            return
        for resident in self.residents:
            for name, m in list(resident.items()):
                if m.users == 0 and self.now - m.last_used_s >= self.keepalive_s:
                    del resident[name]
                    self.evictions += 1

    def _victims(self, keep: str, room_bytes: int | None = None, gpu: int = 0) -> list[str]:
        resident = self.residents[gpu]
        names = [n for n, m in resident.items() if n != keep]
        belady = self.policy == "belady"  # Belady's rule is the plain order: no cover
        return fs.order(
            names,
            model=lambda n: n,
            today=lambda n: resident[n].last_used_s,
            forecast=self._forecast(names, gpu),
            policy="lru" if self.policy in ("lru", "keepalive") else "foresight",
            in_use=lambda n: resident[n].users > 0,
            room_bytes=None if belady else room_bytes,
            size=lambda n: resident[n].bytes,
        )

    def _forecast(self, names: list[str], gpu: int = 0) -> fs.Forecast | None:
        if self.policy == "belady":
            nxt = {}
            for n in names:
                q = self.future.get(n)
                at = q[0] if q else None
                nxt[n] = fs.NextUse(n, at, 1.0 if at is not None else 0.0, "trace")
            same = {n: fs.ReloadCost(1.0, "belady") for n in names}
            return fs.Forecast(self.now, nxt, same)
        if self.policy != "foresight":
            return None
        # What the live machine knows: the line (waiters need their models now) and the past.
        planned = fs.line_plans(
            [(a.name, [model_key(a)]) for t, a in self.line if not t.holding and a.model],
            self.now,
        )
        uses = [
            fs.Use(n, at, by)
            for n in names
            for by, times in self.history.get(n, {}).items()
            for at in times
        ]
        sizes = {n: self.residents[gpu][n].bytes for n in names}
        loads = [fs.Load(n, s) for n, s in self.load_s_of.items() if n in sizes]
        return fs.forecast(sizes, planned, uses, loads, self.now)


def simulate(
    arrivals: Sequence[Arrival],
    gpu_bytes: int,
    policy: str,
    *,
    gpus: int = 1,
    reserve_bytes: int = 0,
    load_s_of: dict[str, float] | None = None,
    keepalive_s: float = KEEPALIVE_S,
) -> Row:
    """Replay ``arrivals`` on a host of ``gpus`` GPUs of ``gpu_bytes`` each (one by default)
    under ``policy`` (one of ``POLICIES``).

    ``reserve_bytes``: memory of each GPU never handed out (the config's ``reserve``);
    ``load_s_of``: a model's measured load time, else its bytes at ``LOAD_BYTES_PER_S``.
    Arrivals that cannot fit (``unfit``) are left out (their waits too) and counted in the
    row's ``unfit``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    budget = max(gpu_bytes - reserve_bytes, 0)
    ok = [a for a in arrivals if fits(a, budget, gpus)]
    sim = _Sim(ok, gpu_bytes, budget, policy, dict(load_s_of or {}), keepalive_s, n_gpus=gpus)
    return replace(sim.run(), unfit=len(arrivals) - len(ok))
