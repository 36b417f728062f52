"""A request once its candidate is chosen and its place held: what its response headers say
(``Meta``), and what the engine gave back, whole or as a stream (``Opened``).

``gpulock.serve.dispatch`` makes them, ``gpulock.serve.cluster_link`` makes them for a request a
peer runs, and the handlers of ``gpulock.serve.gateway`` read the answer out of them and count it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

from gpulock.router import budget
from gpulock.router.routes import Candidate
from gpulock.serve.engines import Answer, Usage


@dataclass(frozen=True, slots=True)
class Meta:
    """What the response headers say: which tier and model answered, and the wait."""

    task: str
    tier: str
    model: str
    waited_ms: float
    ticket: int | None = None  # the GPU ticket the request ran under (gpu tier)
    host: str | None = None  # the cluster host that ran it (None: no cluster)

    def headers(self) -> dict[str, str]:
        out = {
            "X-Gpulock-Tier": self.tier,
            "X-Gpulock-Model": self.model,
            "X-Gpulock-Waited-Ms": f"{self.waited_ms:.1f}",
        }
        if self.host is not None:
            out["X-Gpulock-Host"] = self.host
        return out


class Opened:
    """A request with its candidate chosen and its place held: the answer, or its stream."""

    def __init__(self, meta: Meta, stack: AsyncExitStack, candidate: Candidate) -> None:
        self.meta = meta
        self.stack = stack
        self.candidate = candidate  # what answered: its price is what the call costs
        self.started = time.monotonic()
        self.answer: Answer | None = None
        self.vectors: list[list[float]] = []
        self.tokens_in = 0
        self.first: str | None = None
        self.pieces: AsyncIterator[str] | None = None
        self.usage = Usage()
        # A cloud call's most cost, reserved against its budgets before it (gpulock.router.budget):
        # settled by ``Dispatcher.account``, given back by ``Dispatcher.broke``.
        self.reservation: budget.Reservation | None = None
        self.accounted = False  # counted (answered, or broke off): nothing is left to settle
        self.sent = 0  # pieces of a stream handed to the client so far

    async def rest(self) -> AsyncIterator[str]:
        """Every piece of a streamed answer (the first one included); frees the place at the
        end, or as soon as the consumer stops (a client that hung up)."""
        try:
            if self.first:
                self.sent += 1
                yield self.first
            if self.pieces is not None:
                async for piece in self.pieces:
                    self.sent += 1
                    yield piece
        finally:
            await self.close()

    async def close(self) -> None:
        await self.stack.aclose()
