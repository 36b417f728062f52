"""``Model``: what ``router.get_model`` returns — one handle, whichever tier serves it.

A call goes to the chosen candidate.  When it fails (the model will not load, out of memory, HTTP
429 or 5xx, a timeout, the GPU not free before the deadline) the candidate is cooled down (in the
ledger, so other agents skip it too; not for a busy GPU, a queue is not the model's fault), the
task's candidates are judged again without it, and the call goes to the next that fits;
``.tier``, ``.name`` and ``.why`` follow.  A cloud candidate is also judged again before each
call (budget, rate limit, cooldown: they change as calls are made) and given up the same way,
without a cooldown.  When none is left, ``NoModelAvailable`` lists every candidate and why.

Every call is accounted through ``gpulock.router.accounting`` (the path ``gpulock serve``'s calls
take too): a ``call`` event (task, agent, tier, model, tokens in and out, latency, estimated cost)
in the event log, and spend, usage and cloud requests in the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from gpulock.core.settings import Settings
from gpulock.router import accounting, budget, probe
from gpulock.router.backends import BackendError, Result
from gpulock.router.choose import Choice, Verdict, choose, cid
from gpulock.router.errors import NoModelAvailable
from gpulock.router.routes import Candidate, Table


class Model:
    """A model for one task, chosen for this machine at this moment (see the module doc)."""

    def __init__(
        self,
        task: str,
        table: Table,
        settings: Settings,
        choice: Choice,
        *,
        agent: str,
        deadline_at: float | None,
        prefer: str | None,
    ) -> None:
        self.task = task
        self.agent = agent
        self.choice = choice
        self._table = table
        self._settings = settings
        self._deadline_at = deadline_at
        self._prefer = prefer
        self._backends: dict[str, Any] = {}
        self._reservation: Any = None  # gpulock.router.budget.Reservation of the call under way
        self._failed: dict[str, str] = {}  # cid -> what went wrong, on the call under way
        self.fallbacks: list[str] = []  # "model: why" for each candidate given up on this handle

    # --- what was chosen ---------------------------------------------------------------------

    @property
    def _verdict(self) -> Verdict:
        if self.choice.chosen is None:
            raise NoModelAvailable(self.task, self.choice)
        return self.choice.chosen

    @property
    def candidate(self) -> Candidate:
        return self._verdict.candidate

    @property
    def tier(self) -> str:
        return self.candidate.tier

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def gpu(self) -> int | None:
        return self._verdict.gpu

    @property
    def host(self) -> str:
        """The host that runs the calls: a cluster peer's name, or this host's."""
        return self.candidate.host or _here(self._settings)

    @property
    def why(self) -> str:
        """What was chosen and why; each other candidate and why not; fallbacks so far."""
        text = self.choice.explain()
        if self.fallbacks:
            text += "\n  fell back from: " + "; ".join(self.fallbacks)
        return text

    def __repr__(self) -> str:
        chosen = self.choice.candidate
        what = f"{chosen.tier} {chosen.name}" if chosen else "nothing"
        return f"<router.Model task={self.task!r} {what}>"

    # --- calls -------------------------------------------------------------------------------

    def complete(self, prompt: str, *, stream: bool = False, **kw: Any) -> Any:
        """Text completion: the generated text, or with ``stream=True`` an iterator of pieces.

        Keywords go to the backend (``max_tokens``, ``temperature``, ``stop``...);
        ``max_tokens`` defaults to the route's.
        """
        if stream:
            return self._stream("text", prompt, kw)
        return self._call(
            lambda b, wait, label, args: b.complete(prompt, wait_s=wait, label=label, **args),
            kw,
            prompt,
        )

    def chat(self, messages: list[dict[str, Any]], *, stream: bool = False, **kw: Any) -> Any:
        """Chat over ``[{"role": ..., "content": ...}]``: the reply's text (or its pieces)."""
        if stream:
            return self._stream("chat", messages, kw)
        return self._call(
            lambda b, wait, label, args: b.chat(messages, wait_s=wait, label=label, **args),
            kw,
            messages,
        )

    def unload(self) -> None:
        """Free what this handle loaded (a local model); the next call loads it again."""
        for b in self._backends.values():
            b.unload()

    close = unload

    def _call(
        self,
        run: Callable[[Any, float | None, str, dict[str, Any]], Result],
        kw: dict[str, Any],
        payload: Any,
    ) -> str:
        self._new_call()
        while True:
            v = self._still_fits()
            # Each attempt its own keywords: the next candidate's default max_tokens is its own.
            args = {"max_tokens": v.candidate.max_tokens, **kw}
            if not self._reserve(v, payload, args):
                continue
            backend = self._backend(v)
            start = time.monotonic()
            try:
                result = run(backend, self._wait_s(v.candidate), self._label(), args)
            except BackendError as e:
                self._give_up(v, e, time.monotonic() - start)
                continue
            self._account(v, result.tokens_in, result.tokens_out, time.monotonic() - start)
            return result.text

    def _stream(self, kind: str, payload: Any, kw: dict[str, Any]) -> Iterator[str]:
        self._new_call()
        while True:
            v = self._still_fits()
            args = {"max_tokens": v.candidate.max_tokens, **kw}
            if not self._reserve(v, payload, args):
                continue
            backend = self._backend(v)
            usage: dict[str, int] = {}
            start = time.monotonic()
            started = False
            try:
                pieces = backend.stream(
                    kind,
                    payload,
                    wait_s=self._wait_s(v.candidate),
                    label=self._label(),
                    usage=usage,
                    **args,
                )
                n = 0
                try:
                    for piece in pieces:
                        started = True
                        n += 1
                        yield piece
                except GeneratorExit:
                    # The caller stopped reading: end the backend's stream now (a gpu call
                    # gives the GPU back here, not at garbage collection) and count what it got.
                    pieces.close()
                    elapsed = time.monotonic() - start
                    self._account(v, usage.get("tokens_in", 0), usage.get("tokens_out", n), elapsed)
                    raise
            except BackendError as e:
                if started:
                    # Half an answer cannot be completed by another model: say so.
                    self._give_up(v, e, time.monotonic() - start, retry=False)
                    raise NoModelAvailable(self.task, self.choice, broke=e.short) from None
                self._give_up(v, e, time.monotonic() - start)
                continue
            elapsed = time.monotonic() - start
            self._account(v, usage.get("tokens_in", 0), usage.get("tokens_out", 0), elapsed)
            return

    # --- the parts ---------------------------------------------------------------------------

    def _new_call(self) -> None:
        """Each call starts afresh: what failed on an earlier call is kept out by its cooldown
        (which ends), not by this handle for ever; a handle left with nothing chooses again."""
        self._failed = {}
        if self.choice.chosen is None:
            self.choice = self._choose_again()

    def _still_fits(self) -> Verdict:
        """The chosen candidate, admitted by the accounting (``gpulock.router.accounting.admit``): a
        cloud one is judged again first (calls spend its budget and rate limit, and other
        agents' errors cool it down, so a handle kept for hours must not go on calling past
        them) and its request counted.  When it no longer fits, the call moves on, as on a
        failure."""
        v = self._verdict
        c = v.candidate
        now = accounting.admit(self._settings, self._table.settings, self.task, c)
        if now.ok:
            return v
        self.fallbacks.append(f"{c.name}: {now.reason}")
        self._move_on(c, now.reason)
        return self._verdict

    def _backend(self, v: Verdict) -> Any:
        c = v.candidate
        key = f"{cid(c)}|{c.n_ctx}|{v.gpus or v.gpu}"
        b: Any = self._backends.get(key)
        if b is None:
            if c.host is not None:  # a cluster peer's gateway
                from gpulock.router import peers
                from gpulock.router.backends.peer import PeerBackend

                b = PeerBackend(
                    c,
                    agent=self.agent,
                    me=_here(self._settings),
                    peer_timeout_s=peers.peer_timeout_s(self._settings),
                )
            elif c.local:
                from gpulock.router.backends import llama_cpp

                b = llama_cpp.backend_for(
                    c, self._settings, gpu=v.gpu, need=v.need_bytes, gpus=v.gpus
                )
            elif c.tenant is not None:
                from gpulock.router.backends.tenant import TenantBackend

                b = TenantBackend(c, self._settings, gpu=v.gpu, need=v.need_bytes)
            else:
                from gpulock.router.backends.openai_api import OpenAIBackend

                b = OpenAIBackend(c)
            self._backends[key] = b
        if c.host is not None:
            b.start_s = v.start_s  # this call's expected start there: silence past it fails
        return b

    def _wait_s(self, c: Candidate) -> float:
        if self._deadline_at is None:
            return c.timeout_s
        return max(0.0, min(c.timeout_s, self._deadline_at - time.monotonic()))

    def _label(self) -> str:
        return f"{self.agent}:{self.task}" if self.agent else self.task

    def _host_field(self, c: Candidate) -> dict[str, str]:
        """The ``call`` event's ``host`` in a cluster (the host that ran it); none without."""
        if c.host is None and self._settings.config.section("cluster") is None:
            return {}
        return {"host": c.host or _here(self._settings)}

    def _reserve(self, v: Verdict, payload: Any, args: dict[str, Any]) -> bool:
        """Take a cloud call's request slot (a cluster's shared ``rate_limit``) and reserve its
        most cost against its budgets (gpulock.router.budget); False: a limit or a budget would be
        passed, and the call has moved on to the next candidate."""
        self._reservation = None
        c = v.candidate
        rs = self._table.settings
        limited = budget.take_request(self._settings, c)
        if limited is not None:
            self._failed[cid(c)] = limited
            self.fallbacks.append(f"{c.name}: {limited}")
            self._move_on(c, limited)
            return False
        if not budget.needed(c, rs):
            return True
        limit = args.get("max_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            limit = c.max_tokens
        bound = budget.bound_usd(c, payload, limit, args)  # tools and the like count as prompt
        r = budget.reserve(self._settings, rs, c, bound)
        if isinstance(r, str):
            self._failed[cid(c)] = r
            self.fallbacks.append(f"{c.name}: {r}")
            self._move_on(c, r)
            return False
        self._reservation = r
        return True

    def _give_up(self, v: Verdict, e: BackendError, elapsed: float, *, retry: bool = True) -> None:
        c = v.candidate
        if self._reservation is not None:
            budget.release(self._settings, self._reservation)
            self._reservation = None
        self._failed[cid(c)] = e.short
        accounting.failed(
            self._settings,
            self._table.settings,
            c,
            e,
            task=self.task,
            agent=self.agent,
            latency_s=elapsed,
            **self._host_field(c),
        )
        self.fallbacks.append(f"{c.name}: {e.short}")
        if retry:
            self._move_on(c, e.short)

    def _move_on(self, c: Candidate, why: str) -> None:
        """Choose again without the candidates that failed, and say where the call went."""
        self.choice = self._choose_again()
        nxt = self.choice.chosen
        self._settings.emit(
            "fallback",
            task=self.task,
            agent=self.agent,
            from_model=c.name,
            from_tier=c.tier,
            error=why,
            to_model=nxt.candidate.name if nxt else None,
            to_tier=nxt.candidate.tier if nxt else None,
        )

    def _choose_again(self) -> Choice:
        cands = self._table.tasks[self.task]
        h = probe.host(self._settings, cands, self._table.settings, warm=probe.warm_models())
        deadline_s = None
        if self._deadline_at is not None:
            deadline_s = max(0.0, self._deadline_at - time.monotonic())
        return choose(
            self.task,
            cands,
            h,
            deadline_s=deadline_s,
            prefer=self._prefer,
            exclude=dict(self._failed),
        )

    def _account(self, v: Verdict, tokens_in: int, tokens_out: int, elapsed: float) -> None:
        c = v.candidate
        r, self._reservation = self._reservation, None
        cost = accounting.record(
            self._settings,
            c,
            task=self.task,
            agent=self.agent,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            latency_s=elapsed,
            reserved_usd=r.amount_usd if r is not None else 0.0,
            gpu=v.gpu,
            **self._host_field(c),
        )
        if r is not None:
            budget.settled(self._settings, r, cost)


def _here(settings: Settings) -> str:
    from gpulock.router.peers import here_name

    return here_name(settings)
