"""The residents' side of ``gpulock.lock.room``: room before a grant, by asking models to leave.

``gpulock.acquire`` and ``gpulock.acquire_async`` hand ``ROOM`` to the lock.  Nothing here is
imported by ``import gpulock`` beyond this small module: eviction (sockets, the tenants'
survey) loads only when a grant actually has residents or tenants to ask.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gpulock.lock.room import Kept, Request, Room

if TYPE_CHECKING:
    from gpulock.core.settings import Settings


class _EvictingRoom:
    """Idle, unpinned models of other processes leave before a grant; pinned and busy stay."""

    def make(self, settings: Settings, request: Request) -> Kept | None:
        if request.need_bytes is None:
            return self._clear(settings, request, residents=True)
        if not _anyone(settings):
            return None  # nobody ever registered a model: nothing to ask
        from gpulock.residents import eviction

        eviction.make_room(
            settings,
            request.gpu,
            request.need_bytes,
            exclude_pid=request.pid,
            timeout_s=request.timeout_s,
            reason=request.reason,
            keep_ids=request.calls,
            name=request.name,
        )
        return None

    def unblock(self, settings: Settings, request: Request) -> Kept | None:
        return self._clear(settings, request, residents=False)

    def where_warm(self, settings: Settings, request: Request) -> dict[int, str]:
        """The GPUs of ``request.gpus`` where a model it will load is resident now: a
        resident named as one of ``request.models`` (a model name, or a file's name with or
        without its extension: ``/models/qwen-7b.gguf`` is ``qwen-7b``).  Library residents
        only: asking the tenants' servers would put network calls on the grant's path."""
        if not request.models or not (settings.state_dir / "residents").is_dir():
            return {}
        from gpulock.residents import registry

        names = set()
        for m in request.models:
            base = os.path.basename(m)
            names |= {m, base, os.path.splitext(base)[0]}
        out: dict[int, str] = {}
        for r in registry.Registry(settings, create=False).records(clean=False):
            if r.gpu in request.gpus and (r.name in names or r.id in names):
                out.setdefault(r.gpu, f"{r.name} resident (pid {r.pid})")
        return out

    def _clear(self, settings: Settings, request: Request, *, residents: bool) -> Kept | None:
        """An exclusive grant: the tenants' models (``exclusive_clears_tenants``) and the
        library residents (``exclusive_clears_residents``) on its GPU are asked to leave."""
        cfg = settings.config
        tenants = cfg.exclusive_clears_tenants and any(t.gpu == request.gpu for t in cfg.tenants)
        residents = (
            residents
            and cfg.exclusive_clears_residents
            and (settings.state_dir / "residents").is_dir()
        )
        if not tenants and not residents:
            return None
        from gpulock.residents import eviction

        _results, kept = eviction.clear_gpu(
            settings,
            request.gpu,
            tenants=tenants,
            residents=residents,
            exclude_pid=request.pid,
            timeout_s=request.timeout_s,
            reason=request.reason,
            keep_ids=request.calls,
        )
        return kept


def _anyone(settings: Settings) -> bool:
    return bool(settings.config.tenants) or (settings.state_dir / "residents").is_dir()


ROOM: Room = _EvictingRoom()
