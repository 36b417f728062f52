"""The router's decision, as a pure function: candidates + what the machine looks like -> Choice.

``choose(task, candidates, host, deadline_s=, prefer=)`` walks the task's candidates best first
and gives each a verdict with its reason; the first that fits wins, except that a warm model
(already loaded in this process) beats a cold one of the same tier that is written before it:
a load costs more than the difference between two models of one tier.

Nothing here reads a file, a clock or the environment: ``Host`` carries all of it, so the table
tests cover "no GPU", "6 GB laptop", "governor says reduce", "queue longer than the deadline" and
"budget spent" in microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpulock.core.units import format_duration, format_gpus, format_size, format_usd
from gpulock.router.routes import Candidate
from gpulock.router.tools import ToolSupport, support
from gpulock.router.waitest import HoldHistory, Queued, estimate_wait

REDUCE_MIN_CTX = 512
REDUCE_MIN_BATCH = 32
# The governor's ladder: each level includes the actions of those below it, so smaller contexts
# apply from ``reduce`` up (at ``freeze`` GPU candidates are skipped altogether).
REDUCING_LEVELS = ("reduce", "evict-idle", "force-evict")


def cid(c: Candidate) -> str:
    """What cooldowns, spend and rate limits are kept by: one endpoint's model, across tasks."""
    if c.local:
        return f"llama_cpp:{c.tier}:{c.model}"  # loaded on the GPU is not warm for the CPU tier
    if c.tenant is not None:
        return f"tenant:{c.tenant}/{c.model}"  # warm when that tenant holds the model
    return f"{c.backend}:{c.base_url}:{c.model}"


def preferred(c: Candidate, prefer: str) -> bool:
    """Whether ``prefer`` (a tier, a candidate's name or its model) names ``c``."""
    return prefer in (c.tier, c.name, c.model)


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    total_bytes: int | None
    budget_bytes: int | None  # total minus the configured reserve: the most one need may be
    free_bytes: int | None
    ahead: int = 0  # tickets in the queue now (holders and waiters)
    est_wait_s: float | None = 0.0  # None: cannot tell (no history)
    # The holders' needs summed when a newcomer with a need could join them now (nobody waits,
    # nobody holds exclusively), as gpulock's queue rule shares a GPU; None: it waits in line.
    shared_bytes: int | None = None
    # Who is in line (queue order) and the GPU's hold history: with a history, the wait is
    # estimated per newcomer need by gpulock.router.waitest; without one, ``est_wait_s`` stands.
    line: tuple[Queued, ...] = ()
    history: HoldHistory | None = None
    # The GPU's free memory as gpulock status shows it (``free_bytes`` is that less the
    # configured reserve), and what the lock's holders claim (an exclusive one: all of it).
    shown_free_bytes: int | None = None
    claimed_bytes: int | None = 0


def _no_estimate(c: Candidate) -> int | None:
    return c.vram_bytes


def _tools_unread(c: Candidate) -> ToolSupport:
    return support(c)  # no tenant kind, no chat template read: the probe gives both


@dataclass(frozen=True, slots=True)
class Host:
    gpus: tuple[GpuView, ...] = ()
    gpu_problem: str | None = None  # why there is no GPU information, for the reason text
    level: str = "normal"
    warm: frozenset[str] = frozenset()  # cid()s of models loaded in VRAM or in this process
    env: frozenset[str] = frozenset()  # names of the API-key variables that are set
    missing_files: frozenset[str] = frozenset()
    spend_today_usd: Mapping[str, float] = field(default_factory=dict)  # by cid
    daily_budget_usd: float | None = None  # across all cloud candidates
    cooldown_until: Mapping[str, tuple[float, str]] = field(default_factory=dict)  # by cid
    requests_last_min: Mapping[str, int] = field(default_factory=dict)  # by cid
    now_wall: float = 0.0
    vram_of: Callable[[Candidate], int | None] = _no_estimate
    # Whether a candidate can call tools (gpulock.router.tools), asked only of a request
    # with tools and by ``gpulock route --explain``.
    tools_of: Callable[[Candidate], ToolSupport] = _tools_unread


@dataclass(frozen=True, slots=True)
class Verdict:
    candidate: Candidate
    ok: bool
    reason: str
    gpu: int | None = None
    need_bytes: int | None = None
    warm: bool = False
    # Why a cloud candidate was refused when the reason is an accounting limit: "budget" (its
    # daily_budget or router.daily_budget) or "rate" (its rate_limit); None otherwise.
    limit: str | None = None
    # A request with tools, on a llama_cpp candidate: llama-cpp-python's chat handler to call.
    tool_handler: str | None = None
    # A cluster peer's verdict: when it is expected to start there (its line, its load, the
    # remote penalty), so that a peer that sends nothing by then (plus cluster.peer_timeout)
    # is given up (gpulock.router.backends.peer).  None: not a peer's.
    start_s: float | None = None
    # The GPUs its ticket may wait for (one line in front of them): every usable GPU for a
    # model run in this process without ``gpu:`` on a machine of several; () for one GPU
    # (``gpu``).  ``gpu`` is then the one that looked best, for the estimates.
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    task: str
    chosen: Verdict | None
    verdicts: tuple[Verdict, ...]
    level: str

    @property
    def candidate(self) -> Candidate | None:
        return self.chosen.candidate if self.chosen else None

    def rejected(self) -> list[Verdict]:
        return [v for v in self.verdicts if v is not self.chosen]

    def explain(self) -> str:
        """What was chosen and, for each other candidate, why not (one line each)."""
        lines = []
        if self.chosen is not None:
            c = self.chosen.candidate
            lines.append(f"{self.task}: {c.tier} {c.name} ({c.key}): {self.chosen.reason}")
        else:
            lines.append(f"{self.task}: no candidate fits")
        for v in self.verdicts:
            if v is self.chosen:
                continue
            mark = "passed over" if v.ok else "rejected"
            c = v.candidate
            lines.append(f"  {mark}: {c.tier} {c.name} ({c.key}): {v.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def choose(
    task: str,
    candidates: Sequence[Candidate],
    host: Host,
    *,
    deadline_s: float | None = None,
    prefer: str | None = None,
    exclude: Collection[str] = frozenset(),
    tools: bool = False,
) -> Choice:
    """Judge every candidate, pick one (see the module doc).

    ``exclude``: cids to skip (those that failed on this call); a mapping cid -> what went
    wrong puts the failure in the reason, so NoModelAvailable says why, not just "failed".
    ``tools``: the request has tools: a candidate that cannot call them is rejected, saying why.
    """
    ordered = list(candidates)
    if prefer:
        ordered.sort(key=lambda c: 0 if preferred(c, prefer) else 1)
    verdicts = [_judge(c, host, deadline_s, exclude, tools) for c in ordered]
    fits = [v for v in verdicts if v.ok]
    chosen = fits[0] if fits else None
    if chosen is not None and not chosen.warm:
        warm = next((v for v in fits if v.warm and v.candidate.tier == chosen.candidate.tier), None)
        if warm is not None:
            verdicts = [
                replace(v, reason=f"{v.reason}; passed over for warm {warm.candidate.name}")
                if v is chosen
                else v
                for v in verdicts
            ]
            chosen = next(v for v in verdicts if v.candidate is warm.candidate)
    return Choice(task, chosen, tuple(verdicts), host.level)


def _judge(
    c: Candidate, host: Host, deadline_s: float | None, exclude: Collection[str], tools: bool
) -> Verdict:
    if tools:
        can = host.tools_of(c)
        if not can.ok:
            return Verdict(c, False, str(can))
        v = _judge_any(c, host, deadline_s, exclude)
        return replace(v, tool_handler=can.handler) if v.ok else v
    return _judge_any(c, host, deadline_s, exclude)


def _judge_any(
    c: Candidate, host: Host, deadline_s: float | None, exclude: Collection[str]
) -> Verdict:
    key = cid(c)
    warm = key in host.warm
    if key in exclude:
        what = exclude.get(key) if isinstance(exclude, Mapping) else None
        return Verdict(
            c,
            False,
            f"failed on this call already: {what}" if what else "failed on this call already",
        )
    until = host.cooldown_until.get(key)
    if until is not None and until[0] > host.now_wall:
        left = format_duration(until[0] - host.now_wall)
        return Verdict(c, False, f"cooling down after errors for {left} more (last: {until[1]})")
    if c.local and c.model in host.missing_files:
        return Verdict(c, False, f"model file not found: {c.model} ({c.key}.model)")
    if c.tier == "cloud":
        return _judge_cloud(c, host, warm)
    if c.tier == "cpu":
        return Verdict(c, True, "runs on the CPU" + (" (warm)" if warm else ""), warm=warm)
    return _judge_gpu(c, host, deadline_s, warm)


def _judge_cloud(c: Candidate, host: Host, warm: bool) -> Verdict:
    key = cid(c)
    if c.api_key_env and c.api_key_env not in host.env:
        return Verdict(
            c, False, f"environment variable {c.api_key_env} is not set ({c.key}.api_key_env)"
        )
    spent = host.spend_today_usd.get(key, 0.0)
    if c.daily_budget_usd is not None and spent >= c.daily_budget_usd:
        return Verdict(
            c,
            False,
            f"daily budget spent: ${spent:.4f} of {format_usd(c.daily_budget_usd)} today",
            limit="budget",
        )
    total = sum(host.spend_today_usd.values())
    if host.daily_budget_usd is not None and total >= host.daily_budget_usd:
        return Verdict(
            c,
            False,
            f"cloud budget spent: ${total:.4f} of {format_usd(host.daily_budget_usd)} today "
            "(router.daily_budget)",
            limit="budget",
        )
    used = host.requests_last_min.get(key, 0)
    if c.rate_limit_per_min is not None and used >= c.rate_limit_per_min:
        return Verdict(
            c,
            False,
            f"rate limit: {used} requests in the last minute (of {c.rate_limit_per_min})",
            limit="rate",
        )
    return Verdict(c, True, f"cloud, ${spent:.4f} spent today", warm=warm)


def _judge_gpu(c: Candidate, host: Host, deadline_s: float | None, warm: bool) -> Verdict:
    if not host.gpus:
        why = f": {host.gpu_problem}" if host.gpu_problem else ""
        return Verdict(c, False, f"no GPU{why}")
    if host.level == "freeze":
        return Verdict(c, False, "governor level freeze: new GPU work waits")
    note = ""
    if host.level in REDUCING_LEVELS:
        n_ctx = max(min(c.n_ctx, REDUCE_MIN_CTX), c.n_ctx // 2)
        n_batch = max(min(c.n_batch, REDUCE_MIN_BATCH), c.n_batch // 2)
        if (n_ctx, n_batch) != (c.n_ctx, c.n_batch):
            note = f"; governor level {host.level}: n_ctx {c.n_ctx} -> {n_ctx}"
            c = replace(c, n_ctx=n_ctx, n_batch=n_batch)
    need = host.vram_of(c)
    gpus = [g for g in host.gpus if c.gpu is None or g.index == c.gpu]
    if not gpus:
        return Verdict(c, False, f"no gpu{c.gpu} on this machine ({c.key}.gpu)")
    problems: list[str] = []
    usable: list[GpuView] = []
    for g in gpus:
        problem = _gpu_problem(c, g, need, deadline_s)
        if problem is None:
            usable.append(g)
        else:
            problems.append(problem)
    if not usable:
        return Verdict(c, False, "; ".join(problems))

    def rank(g: GpuView) -> tuple[int, float, int]:
        fits_now = need is None or g.free_bytes is None or g.free_bytes >= need
        return (0 if fits_now else 1, _wait_s(g, need) or 0.0, -(g.free_bytes or 0))

    best = min(usable, key=rank)
    if not best.ahead:
        wait = ""
    elif _shares(best, need):
        wait = f", shared with {best.ahead} holder{'s' if best.ahead > 1 else ''}"
    else:
        wait = f", ~{format_duration(_wait_s(best, need))} queue wait"
    size = f"needs {format_size(need)}" if need is not None else "needs the whole GPU"
    # A model this process loads, with no gpu: pinned, waits in one line in front of every
    # GPU it fits (its ticket is granted whichever frees first), not the one that looks best.
    spread: tuple[int, ...] = ()
    if c.gpu is None and c.tenant is None and c.local and len(usable) > 1:
        spread = tuple(sorted(g.index for g in usable))
    where = f"gpu{best.index}" if not spread else f"any of {format_gpus(spread)}"
    reason = f"{where}: {size}{wait}" + (" (warm)" if warm else "") + note
    return Verdict(c, True, reason, gpu=best.index, need_bytes=need, warm=warm, gpus=spread)


def line_wait(host: Host, v: Verdict) -> tuple[float | None, int]:
    """The wait (seconds; None: cannot tell) and tickets ahead on ``v``'s GPU, as judged."""
    g = next((g for g in host.gpus if g.index == v.gpu), None)
    if g is None:
        return 0.0, 0
    return (_wait_s(g, v.need_bytes) if g.ahead else 0.0), g.ahead


def _gpu_problem(
    c: Candidate, g: GpuView, need: int | None, deadline_s: float | None
) -> str | None:
    """Why this GPU cannot serve the candidate, or None when it can."""
    total, least = g.total_bytes, c.min_vram_bytes
    if total is not None and least is not None and total < least:
        return f"needs a GPU of {format_size(least)}, gpu{g.index} has {format_size(total)}"
    if need is not None and g.budget_bytes is not None and need > g.budget_bytes:
        return (
            f"too little VRAM: needs {format_size(need)}, "
            f"gpu{g.index} has {format_size(g.budget_bytes)} (after the reserve)"
        )
    wait = _wait_s(g, need)
    if deadline_s is not None and g.ahead and wait is not None and wait > deadline_s:
        return (
            f"gpu{g.index} queue: ~{format_duration(wait)} wait "
            f"({g.ahead} ahead) > deadline {format_duration(deadline_s)}"
        )
    return None


def _shares(g: GpuView, need: int | None) -> bool:
    """Would the lock grant ``need`` at once, next to the holders (its sharing rule)?"""
    if need is None or g.shared_bytes is None or g.budget_bytes is None:
        return False
    return g.shared_bytes + need <= g.budget_bytes


def _wait_s(g: GpuView, need: int | None) -> float | None:
    if _shares(g, need):
        return 0.0
    if g.history is not None:
        return estimate_wait(g.line, g.history, need_bytes=need, budget_bytes=g.budget_bytes)
    return g.est_wait_s
