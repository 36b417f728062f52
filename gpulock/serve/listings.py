"""What ``gpulock serve`` says about itself and its models, asked with a GET: the model lists
(``/v1/models``, ``/api/tags``, ``/api/ps``), ``/``, ``/api/version``, ``/health``,
``/gpulock/status``, ``/gpulock/cluster``, ``/metrics`` and ``/openapi.json``.  None of them
waits in the line; what reads files or asks the tenants runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from gpulock import status
from gpulock.core.settings import Settings
from gpulock.serve import api_ollama, api_openai
from gpulock.serve.dispatch import Dispatcher
from gpulock.serve.errors import ApiError


class Listings:
    """The GET endpoints of ``gpulock.serve.gateway.Gateway``, which builds on them."""

    settings: Settings
    d: Dispatcher

    async def _names(self) -> list[str]:
        """Tasks first, then candidates, then the tenants' models (``TENANT/MODEL``)."""
        known = self.d.known()
        held = await asyncio.to_thread(self.d.tenant_models)  # asks the tenants: off the loop
        return known + [n for n in held if n not in known]

    async def openai_models(self, request: Request) -> Response:
        return JSONResponse(api_openai.models(await self._names()))

    async def ollama_tags(self, request: Request) -> Response:
        sizes = {c.name: c.vram_bytes or 0 for c in self.d.candidates()}
        return JSONResponse(api_ollama.tags([(n, sizes.get(n, 0)) for n in await self._names()]))

    async def ollama_ps(self, request: Request) -> Response:
        rows: dict[str, tuple[str, int, int]] = {}
        for b in self.d.loaded():  # a model and its embedding context: one entry
            size = b.need or 0
            name = b.candidate.name
            old = rows.get(name, (name, 0, 0))
            rows[name] = (name, old[1] + size, old[2] + (size if b.gpu is not None else 0))
        return JSONResponse(api_ollama.ps(list(rows.values())))

    async def ollama_version(self, request: Request) -> Response:
        return JSONResponse({"version": api_ollama.API_VERSION})

    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def health(self, request: Request) -> Response:
        line = self.d.line
        running = sum(line.held().values())
        out: dict[str, Any] = {"status": "ok", "waiting": line.waiting, "running": running}
        if self.d.cluster is not None:
            out["cluster"] = self.d.cluster.health()
        return JSONResponse(out)

    async def gpulock_cluster(self, request: Request) -> Response:
        """The fleet, as ``gpulock cluster --json`` prints it (404 without a cluster)."""
        if self.d.cluster is None:
            raise ApiError(404, "this gpulock serve is not in a cluster (config: cluster:)")
        return JSONResponse(self.d.cluster.fleet_object())

    async def metrics(self, request: Request) -> Response:
        """The Prometheus exposition of this state folder (as ``gpulock metrics`` prints it)."""
        from gpulock.metrics.collector import CONTENT_TYPE, exposition

        body = await asyncio.to_thread(exposition, self.settings)
        return Response(body, media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        from gpulock.serve.openapi import document

        return JSONResponse(document(self.d.known()))

    async def gpulock_status(self, request: Request) -> Response:
        snap = await asyncio.to_thread(status.snapshot, self.settings)
        return JSONResponse(snap)
