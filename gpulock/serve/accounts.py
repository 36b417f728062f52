"""What a request of ``gpulock serve`` costs in the router's ledger, taken and settled by the
rules ``router.get_model`` follows: before a cloud call with limits, its rate and its most cost
are taken (``_admit``); an answer is counted once and its reservation settled (``account``); a
call that failed or broke off cools its candidate down and gives its reservation back.

The ledger is ``gpulock.router.books``, kept in memory and written behind.  Work that may call
the cluster's Redis runs off the event loop; work on local files runs where it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpulock.core.settings import Settings
from gpulock.router import accounting, budget
from gpulock.router.backends import BackendError
from gpulock.router.books import Books
from gpulock.router.choose import Verdict
from gpulock.router.routes import Candidate, Table
from gpulock.serve.engines import Ask
from gpulock.serve.opened import Opened

T = TypeVar("T")
log = logging.getLogger("gpulock.serve")


class Accounts:
    """The accounting side of ``gpulock.serve.dispatch.Dispatcher``, which builds on it: the
    ledger (``books``) is its, and ``cluster`` says whether the ledger is shared through Redis."""

    settings: Settings
    table: Table
    books: Books
    cluster: object | None

    async def _admit(
        self, task: str, c: Candidate, v: Verdict, ask: Ask
    ) -> tuple[Verdict, budget.Reservation | None]:
        """What ``router.get_model`` takes before a cloud call with limits, taken here by the
        same rule: a request of the endpoint's ``rate_limit`` (across the cluster), and the
        call's most cost (its prompt, and ``max_tokens`` of output) reserved against its
        budgets; from the blocks this process holds, else from the shared ledger
        (``gpulock.router.books``).  (The verdict, the reservation or None), or the refusal."""
        need = self._need(c, ask) if budget.needed(c, self.table.settings) else None
        taken = self.books.from_hold(c, need)
        if taken is not None:
            return v, taken[0]
        taking = asyncio.ensure_future(self._off_loop(self.books.admit, task, c, v, need))
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:  # the client left while Redis answered: give it back
            taking.add_done_callback(self._release_later)
            raise

    def _need(self, c: Candidate, ask: Ask) -> float:
        """A call's most cost (``gpulock.router.budget.bound_usd``)."""
        payload: Any = ask.messages if ask.kind == "chat" else ask.prompt
        if ask.tools:  # their schemas are prompt tokens too
            payload = [*ask.messages, *ask.tools]
        limit = ask.params.get("max_tokens")
        if ask.kind == "embed":
            payload, limit = ask.inputs, 0  # an embedding has no output tokens
        elif not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            limit = c.max_tokens  # what _try will ask for
        return budget.bound_usd(c, payload, limit, ask.params)

    async def _release(self, r: budget.Reservation | None) -> None:
        """Give a reservation back: the call it was for did not happen."""
        if r is not None and r.block_day is not None:
            self.books.release(r)  # into its block, in memory
        elif r is not None:
            await self._off_loop(self.books.release, r)

    def _release_later(
        self, taking: asyncio.Future[tuple[Verdict, budget.Reservation | None]]
    ) -> None:
        if taking.cancelled() or taking.exception() is not None:
            return
        _v, r = taking.result()
        if r is not None:
            asyncio.get_running_loop().run_in_executor(None, self.books.release, r)

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn`` run where it cannot stall the event loop: in a thread when it may call the
        cluster's Redis (up to its 0.5 s timeout), here when it only touches local files."""
        if self.cluster is None:
            return fn(*args, **kw)
        return await asyncio.to_thread(fn, *args, **kw)

    def _later(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """``fn`` now when it only touches local files; in a thread, not waited for, when it
        may call the cluster's Redis (the answer is already on its way to the client)."""
        if self.cluster is None:
            fn(*args, **kw)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            fn(*args, **kw)
        else:
            loop.run_in_executor(None, lambda: fn(*args, **kw))

    def _failed(self, *args: Any, **kw: Any) -> None:
        """``accounting.failed`` (a cooldown in the ledger file), then read the file again."""
        accounting.failed(*args, **kw)
        self.books.changed()

    def account(
        self, opened: Opened, agent: str, tokens_in: int, tokens_out: int, **extra: Any
    ) -> None:
        """Count an answered request, through the router's one accounting path, and settle
        its reservation (once: a request is counted at most once)."""
        if opened.accounted:
            return
        opened.accounted = True
        r, opened.reservation = opened.reservation, None
        m = opened.meta
        cost = self.books.record(
            opened.candidate,
            task=m.task,
            agent=agent,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            latency_s=time.monotonic() - opened.started,
            reservation=r,
            via="serve",
            waited_ms=round(m.waited_ms, 3),
            ticket=m.ticket,
            **_host_field(m.host),
            **extra,
        )
        if r is not None and r.block_day is None and r.clustered:
            self._later(budget.settled, self.settings, r, cost)

    def hung_up(self, opened: Opened, agent: str) -> None:
        """A stream the client left before its end: counted with what it got, as
        ``router.get_model`` counts a stream its caller stopped reading (the upstream's usage
        when it came, else a token a piece sent), and its reservation settled."""
        u = opened.usage
        self.account(opened, agent, u.tokens_in, u.tokens_out or opened.sent, client_gone=True)

    def broke(self, opened: Opened, agent: str, e: BackendError) -> None:
        """A stream that broke after its first word: too late to fall back, but the call is
        counted as failed and its candidate cools down as one that failed before would.  Its
        reservation is given back, as ``router.get_model`` gives it back."""
        if opened.accounted:
            return
        opened.accounted = True
        r, opened.reservation = opened.reservation, None
        if r is not None:
            self._later(self.books.release, r)
        c = opened.candidate
        self._later(
            self._failed,
            self.settings,
            self.table.settings,
            c,
            e,
            task=opened.meta.task,
            agent=agent,
            latency_s=time.monotonic() - opened.started,
            via="serve",
        )

    def idle(self) -> None:
        """No request is in flight: what the blocks hold unused goes back to the shared ledger
        (before the last response is sent, without a cluster: what a client reads after its
        answer is settled)."""
        if self.books.holding():
            self._later(self._give_back)

    def _give_back(self) -> None:
        try:
            self.books.idle()
        except Exception:  # the answer is made: a ledger that cannot be written now is logged
            log.exception("could not give back what the accounting holds ahead")


def _host_field(host: str | None) -> dict[str, Any]:
    """The ``call`` event's ``host`` (the cluster host that ran it), without a cluster none."""
    return {"host": host} if host is not None else {}
