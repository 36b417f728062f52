"""Making room before a grant: the one thing the lock asks of the rooms above it.

A granted holder may meet models that other processes keep in GPU memory between calls (a
library's resident, a server's model): the lock cannot see them, and must not import what
can.  So the caller of the lock hands it a ``Room``: the public ``gpulock.acquire`` and
``gpulock.acquire_async`` pass the residents' (``gpulock.residents.room``), which asks idle
models to leave and verifies the memory came back.  The lock's own entry points take ``room``
as a required argument: forgetting it is a TypeError, never a silent skip.  ``NO_ROOM`` is the
explicit "make none" for tools and tests that want the bare line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpulock.core.settings import Settings

# A ticket whose command is [TENANT_CALL, "TENANT/MODEL"] is a routed call to that tenant model:
# making room for it (or clearing the GPU for it) never evicts the model it is about to call.
TENANT_CALL = "gpulock-tenant-call"


@dataclass(frozen=True, slots=True)
class Request:
    """One ticket about to be granted (or stuck behind a server), as room-making sees it."""

    gpu: int
    need_bytes: int | None  # None: an exclusive ticket, the whole GPU
    seq: int
    name: str
    pid: int
    calls: frozenset[str]  # the tenant models this ticket is a routed call to: never evicted
    timeout_s: float  # for all the room-making together: the ticket has a deadline
    reason: str
    gpus: tuple[int, ...] = ()  # the set it may be granted on (a set ticket's; else its gpu)
    models: tuple[str, ...] = ()  # what it will load (its prefetch files), for where_warm


# What stayed on the GPU and why, for the grant event: {"id", "why", "tenant"} ("tenant": its
# tenant's name, "" for a library resident).
Kept = list[dict[str, str]]


class Room(Protocol):
    """What the waiter asks before it grants, and while an exclusive ticket waits."""

    def make(self, settings: Settings, request: Request) -> Kept | None:
        """Free ``need_bytes`` on the GPU, or clear what is idle on it for an exclusive ticket.

        Returns what stayed (pinned, in use, not freed) when the GPU was cleared, else None.
        Never raises for a resident's sake: the grant goes on with what could be freed.
        """
        ...

    def unblock(self, settings: Settings, request: Request) -> Kept | None:
        """An exclusive ticket waits behind a command tenant's server, which holds its own
        ticket for as long as it runs: stop the idle ones now, or the wait never ends."""
        ...


class Placer(Protocol):
    """What a Room may also say (optional): where a ticket's model is warm already.

    Asked only when a ticket for a set of GPUs could take more of them than it needs: the
    waiter prefers those returned (``gpulock.lock.queue.place``).
    """

    def where_warm(self, settings: Settings, request: Request) -> dict[int, str]:
        """GPU -> why (``"qwen.gguf resident (pid 4711)"``) for each GPU of ``request.gpus``
        where one of ``request.models`` is loaded now."""
        ...


class _NoRoom:
    """Makes no room: the bare line (tests of the lock, tools that manage memory themselves)."""

    def make(self, settings: Settings, request: Request) -> Kept | None:
        return None

    def unblock(self, settings: Settings, request: Request) -> Kept | None:
        return None


NO_ROOM: Room = _NoRoom()


def calls_of(command: tuple[str, ...]) -> frozenset[str]:
    """The tenant model a ticket's command is a routed call to (see ``TENANT_CALL``): the
    command is ``[TENANT_CALL, "TENANT/MODEL"]``, or ends with that pair (``gpulock serve``'s
    tickets name the server and the request first)."""
    if len(command) >= 2 and command[-2] == TENANT_CALL:
        return frozenset({command[-1]})
    return frozenset()


def require(room: Room | None) -> Room:
    """``room`` itself; a TypeError naming the fix when it is missing."""
    if room is None:
        raise TypeError(
            "the lock needs a Room to make room before a grant: use gpulock.acquire(), or pass "
            "room=gpulock.lock.room.NO_ROOM to take the bare line on purpose"
        )
    return room
