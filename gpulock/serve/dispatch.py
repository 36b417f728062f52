"""From a request's ``model`` to an answer: resolve the name, choose a candidate as
``router.get_model`` does, wait in the line for a GPU candidate, call the engine, and fall back
along the route when a candidate fails before its first word.

A ``model`` is a task of ``routes:`` (the router picks the candidate for this moment), a
candidate's ``name`` (that candidate only), or ``TENANT/MODEL`` (a model of a configured tenant,
called through that tenant: ``gpulock.router.backends.tenant``).  What a request costs in the
router's ledger is ``gpulock.serve.accounts``'s, which ``Dispatcher`` builds on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from gpulock.core.errors import ConfigError, LockTimeout
from gpulock.core.settings import Settings
from gpulock.router import accounting, budget, probe
from gpulock.router.backends import BackendError
from gpulock.router.backends.tenant import TenantBackend
from gpulock.router.books import Books
from gpulock.router.choose import Choice, Host, Verdict, choose, cid
from gpulock.router.routes import Candidate, Table, tenant_candidate
from gpulock.serve.accounts import Accounts
from gpulock.serve.engines import (
    Ask,
    LocalEngine,
    TenantEngine,
    _EmbedLlama,
    _HeldLlama,
)
from gpulock.serve.errors import ApiError, unknown_model
from gpulock.serve.line import Line, QueueFull
from gpulock.serve.opened import Meta, Opened
from gpulock.serve.remote import RemoteEngine

if TYPE_CHECKING:
    from gpulock.cluster.config import ClusterConfig


# HTTP statuses that blame the request, not the candidate: no fallback, the client hears it.
REQUEST_FAULTS = frozenset({400, 413, 422})


class Elsewhere(Protocol):
    """The other hosts a request may run on: ``gpulock.serve.cluster_link.ClusterLink``, which
    builds on this module (named here in words only, so that the two stay a line, not a circle)."""

    cc: ClusterConfig

    async def relocate(
        self, d: Dispatcher, ask: Ask, choice: Choice, host: Host, agent: str, left: float | None
    ) -> Opened | None: ...

    def health(self) -> dict[str, Any]: ...

    def fleet_object(self) -> dict[str, Any]: ...


class Dispatcher(Accounts):
    def __init__(self, settings: Settings, table: Table, line: Line) -> None:
        self.settings = settings
        self.table = table
        self.line = line
        self._http: Any = None  # the upstream client (gpulock.serve.upstream), made on first use
        self._local: dict[tuple[Any, ...], _HeldLlama] = {}
        self._tenants: dict[tuple[Any, ...], TenantBackend] = {}
        self.cluster: Elsewhere | None = None  # set by `gpulock serve` with a cluster: section
        # The router's ledger, kept in memory and written behind (gpulock.router.books).
        self.books = Books(settings, table.settings)

    def http(self) -> Any:
        """The one client session for OpenAI-compatible servers (made inside the event loop)."""
        if self._http is None:
            from gpulock.serve.upstream import Client

            self._http = Client(keepalive_s=30.0)
        return self._http

    # --- names -------------------------------------------------------------------------------

    def candidates(self) -> list[Candidate]:
        """Every candidate once (by name), in table order."""
        seen: dict[str, Candidate] = {}
        for cands in self.table.tasks.values():
            for c in cands:
                seen.setdefault(c.name, c)
        return list(seen.values())

    def known(self) -> list[str]:
        """Task names first, then the candidates' names."""
        tasks = list(self.table.tasks)
        return tasks + [c.name for c in self.candidates() if c.name not in self.table.tasks]

    def tenant_models(self) -> list[str]:
        """``TENANT/MODEL`` of every model the configured tenants hold now (asked in
        parallel, with short timeouts; a tenant that is down lists nothing)."""
        if not self.settings.config.tenants:
            return []
        from gpulock.residents import registry

        return sorted({r.id for r in registry.tenant_records(self.settings)})

    def resolve(self, model: str) -> tuple[str, tuple[Candidate, ...]]:
        if model in self.table.tasks:
            return model, self.table.tasks[model]
        for c in self.candidates():
            if c.name == model:
                return c.task, (c,)
        if "/" in model:
            tenant, _, name = model.partition("/")
            try:
                return model, (tenant_candidate(self.settings.config, tenant, name),)
            except ConfigError:
                tenants = ", ".join(t.name for t in self.settings.config.tenants)
                raise ApiError(
                    404,
                    f"model {model!r}: no tenant {tenant!r} "
                    f"(tenants: {tenants or 'none configured'}); "
                    f"known models: {', '.join(self.known())}",
                    code="model_not_found",
                    param="model",
                ) from None
        raise unknown_model(model, self.known())

    # --- a request ---------------------------------------------------------------------------

    async def open(
        self, ask: Ask, *, agent: str, deadline_s: float | None, local_only: bool = False
    ) -> Opened:
        """``local_only``: a request a peer forwarded here runs here (no second hop)."""
        task, cands = self.resolve(ask.model)
        deadline_at = None if deadline_s is None else time.monotonic() + deadline_s
        failed: dict[str, str] = {}
        refused: dict[str, Verdict] = {}  # cid -> accounting's refusal (a budget, a rate limit)
        start = time.monotonic()
        while True:
            left = None if deadline_at is None else max(0.0, deadline_at - time.monotonic())
            choice, host = self._choose(task, cands, left, failed, bool(ask.tools))
            if self.cluster is not None and not local_only:
                # A peer that starts it sooner takes it (it waits in the peer's line there).
                opened = await self.cluster.relocate(self, ask, choice, host, agent, left)
                if opened is not None:
                    return opened
            v = choice.chosen
            if v is None:
                raise self._none_left(task, choice, deadline_s, refused, ask.model)
            c = v.candidate
            # Budgets and rate limits, judged by the rule router.get_model's are, taken from
            # what this process holds ahead (gpulock.router.books).  A candidate without limits
            # was judged by the choice just made, from the same view of the ledger (its
            # cooldowns, its key): nothing to take.
            held: budget.Reservation | None = None
            if accounting.limited(c, self.table.settings):
                admitted, held = await self._admit(task, c, v, ask)
                if not admitted.ok:  # get_model moves on here too
                    failed[cid(c)] = admitted.reason
                    refused[cid(c)] = admitted
                    self._fallback(task, agent, c, admitted.reason)
                    continue
            opened = await self._attempt(ask, v, agent, left, start, task, held, failed)
            if opened is not None:
                return opened

    async def _attempt(
        self,
        ask: Ask,
        v: Verdict,
        agent: str,
        left: float | None,
        start: float,
        task: str,
        held: budget.Reservation | None,
        failed: dict[str, str],
    ) -> Opened | None:
        """The chosen candidate tried: its answer opened, holding ``held``; or None when it
        falls back (its GPU queue past the deadline, its server failing: ``failed`` says why,
        ``held`` is given back).  A fault of the request itself is a 400, not a fall-back."""
        c = v.candidate
        stack = AsyncExitStack()
        tried = time.monotonic()
        try:
            opened = await self._try(ask, v, agent, left, start, stack, task)
        except LockTimeout:
            await stack.aclose()
            await self._release(held)
            failed[cid(c)] = "GPU queue past the deadline"
            self._fallback(task, agent, c, "busy")
            return None
        except BackendError as e:
            await stack.aclose()
            await self._release(held)
            if e.kind == "request" or (e.kind == "client" and e.status in REQUEST_FAULTS):
                raise ApiError(400, f"{c.name}: {e}", code="invalid_request") from None
            failed[cid(c)] = e.short
            await self._off_loop(
                self._failed,
                self.settings,
                self.table.settings,
                c,
                e,
                task=task,
                agent=agent,
                latency_s=time.monotonic() - tried,
                via="serve",
            )
            self._fallback(task, agent, c, e.short)
            return None
        except BaseException:
            await stack.aclose()
            await self._release(held)
            raise
        opened.reservation = held
        return opened

    async def _try(
        self,
        ask: Ask,
        v: Verdict,
        agent: str,
        left: float | None,
        start: float,
        stack: AsyncExitStack,
        task: str,
    ) -> Opened:
        c = v.candidate
        ticket = None
        if c.tier == "gpu" and not self.own_ticket(c):
            assert v.gpu is not None
            timeout = c.timeout_s if left is None else min(c.timeout_s, left)
            slot = await stack.enter_async_context(
                self.line.slot(
                    f"{cid(c)}|{v.gpus or v.gpu}",
                    gpu=v.gpu,
                    gpus=v.gpus,
                    prefer=self._loaded_on(c) if v.gpus else None,
                    need=v.need_bytes,
                    parallel=c.parallel,
                    name=agent,
                    timeout_s=timeout,
                    command=("gpulock-serve", ask.model, c.name),
                )
            )
            ticket = slot.ticket
            if v.gpus:  # one line for several GPUs: the model runs where the ticket was granted
                v = replace(v, gpu=slot.gpu)
        if ask.kind != "embed" and "max_tokens" not in ask.params:
            ask = replace(ask, params={**ask.params, "max_tokens": c.max_tokens})  # the route's
        host = self.cluster.cc.host if self.cluster is not None else None
        meta = Meta(task, c.tier, c.name, (time.monotonic() - start) * 1000, ticket, host)
        return await self.run(ask, Opened(meta, stack, c), self._engine(v))

    async def run(
        self, ask: Ask, opened: Opened, engine: LocalEngine | RemoteEngine | TenantEngine
    ) -> Opened:
        """Call ``engine``: the answer, the vectors, or the stream's first piece."""
        stack = opened.stack
        if ask.kind == "embed":
            opened.vectors, opened.tokens_in = await engine.embed(ask.inputs)
            await stack.aclose()
        elif ask.stream:
            pieces = engine.stream(ask, opened.usage)
            stack.push_async_callback(_aclose, pieces)
            try:
                opened.first = await pieces.__anext__()
            except StopAsyncIteration:
                opened.first = ""
            opened.pieces = pieces
        else:
            opened.answer = await engine.answer(ask)
            await stack.aclose()
        return opened

    def _choose(
        self,
        task: str,
        cands: tuple[Candidate, ...],
        left: float | None,
        failed: dict[str, str],
        tools: bool = False,
    ) -> tuple[Choice, Host]:
        """``tools``: the request has tools: only candidates that can call them."""
        warm = probe.warm_models() | {cid(b.candidate) for b in self._local.values() if b.loaded}
        # The governor's level is read for GPU work only: it changes nothing else (and a
        # request for a cloud or CPU model then costs no file read).
        lvl = None if any(c.tier == "gpu" for c in cands) else "normal"
        led = self.books.view()
        host = probe.host(
            self.settings, cands, self.table.settings, warm=warm, led=led, level_now=lvl
        )
        choice = choose(task, cands, host, deadline_s=left, exclude=failed, tools=tools)
        if any(v.limit for v in choice.verdicts) and self.books.holding():
            # What this process holds ahead is counted in the file as taken, yet is its own
            # to use: the limits are judged again without it.
            host = self.books.seen(host)
            choice = choose(task, cands, host, deadline_s=left, exclude=failed, tools=tools)
        return choice, host

    def _none_left(
        self,
        task: str,
        choice: Choice,
        deadline_s: float | None,
        refused: dict[str, Verdict],
        asked: str,
    ) -> ApiError:
        reasons = "; ".join(f"{v.candidate.name}: {v.reason}" for v in choice.verdicts)
        # The name the client asked for: a candidate's name is not its task's.
        what = f"{task!r}" if asked == task else f"{asked!r} (of task {task!r})"
        timed = deadline_s is not None and any(
            "deadline" in v.reason for v in choice.verdicts if not v.ok
        )
        limit = None if timed else accounting.refusal(self.settings, choice, refused)
        if limit is not None:  # a budget or a rate limit: OpenAI's 429s
            kind = "insufficient_quota" if limit.kind == "budget" else "rate_limit_exceeded"
            headers = {"X-Gpulock-Refused": limit.kind}
            if limit.retry_after_s is not None:
                headers["Retry-After"] = str(max(1, math.ceil(limit.retry_after_s)))
            else:
                headers["x-should-retry"] = "false"  # the openai client: no retry until tomorrow
            return ApiError(429, limit.message, type=kind, code=kind, headers=headers)
        if timed:
            return ApiError(
                504,
                f"no model for {what} can answer within the deadline: {reasons}",
                type="timeout_error",
                code="deadline_exceeded",
            )
        return ApiError(
            503,
            f"no model available for {what}: {reasons}",
            type="server_error",
            code="model_unavailable",
            headers={"Retry-After": "5"},
        )

    def own_ticket(self, c: Candidate) -> bool:
        """A ``kind: command`` tenant's server holds its own ticket for as long as it runs: a
        call to it takes no second one (it would wait behind the server for ever)."""
        if c.tenant is None:
            return False
        spec = next((t for t in self.settings.config.tenants if t.name == c.tenant), None)
        return spec is not None and spec.kind == "command"

    def _engine(self, v: Verdict) -> LocalEngine | RemoteEngine | TenantEngine:
        c = v.candidate
        if c.tenant is not None:
            key = (c.tenant, c.model, c.policy, c.keep_alive_s, v.gpu)
            b = self._tenants.get(key)
            if b is None:
                b = self._tenants[key] = TenantBackend(
                    c, self.settings, gpu=v.gpu, need=v.need_bytes, held=True
                )
            return TenantEngine(b)
        if not c.local:
            return RemoteEngine(c, self.http())
        return LocalEngine(
            self._backend(v, _HeldLlama), self._backend(v, _EmbedLlama), v.tool_handler
        )

    def _backend(self, v: Verdict, kind: type[_HeldLlama]) -> _HeldLlama:
        c = v.candidate
        key = (kind, c.model, c.tier, c.n_gpu_layers, v.gpu)
        b = self._local.get(key)
        if b is not None and b.candidate.n_ctx < c.n_ctx and b.loaded:
            b.unload()  # a larger context is asked for than the loaded one has
            b = None
        if b is None:
            b = self._local[key] = kind(c, self.settings, gpu=v.gpu, need=v.need_bytes, gpus=v.gpus)
        return b

    def loaded(self) -> list[_HeldLlama]:
        return [b for b in self._local.values() if b.loaded]

    def _loaded_on(self, c: Candidate) -> dict[int, str]:
        """The GPUs where this server has ``c``'s model loaded: its ticket prefers them."""
        return {
            b.gpu: "loaded in gpulock serve"
            for b in self._local.values()
            if b.loaded and b.gpu is not None and cid(b.candidate) == cid(c)
        }

    def _fallback(self, task: str, agent: str, c: Candidate, why: str) -> None:
        self.settings.emit(
            "fallback", task=task, agent=agent, from_model=c.name, from_tier=c.tier, error=why
        )

    async def shutdown(self) -> None:
        await self._off_loop(self.books.idle)  # what the blocks hold goes back (Redis too)
        self.books.flush()
        if self._http is not None:
            await self._http.close()
        for b in list(self._local.values()):
            await asyncio.to_thread(b.unload)


async def _aclose(it: AsyncIterator[str]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


__all__ = ["Dispatcher", "QueueFull"]
