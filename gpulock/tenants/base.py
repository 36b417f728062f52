"""The one small interface every tenant adapter implements, and the records it returns.

An adapter speaks to one model server (``TenantSpec.kind``) over its own HTTP API::

    a = adapter_for(spec)            # gpulock.tenants.adapter_for
    seen = a.list()                  # Seen: the kind it says it is, and its models
    a.unload("qwen2.5:7b")           # ask; returns when the server took the request
    a.load("qwen2.5:7b")             # bring one in (not every kind can)
    a.health()                       # None when healthy, else why not

``unload`` is only a request: the caller (``gpulock.residents.tenant_evict``) verifies that the
memory came back by listing again (and by NVML per process on a real GPU).  ``force`` lets an
adapter do what it otherwise refuses (ComfyUI's ``/free`` with a job queued).  Every method
raises ``TenantError`` (``gpulock.tenants.http``) and nothing else for what a server does wrong.

The ``TENANT/MODEL`` name (``ollama/qwen2.5:7b``) is a tenant model's resident id everywhere:
``gpulock status``, ``gpulock evict``, events, the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from gpulock.core.tenantspec import TenantSpec
from gpulock.tenants.http import Client

STATES = ("loading", "loaded", "sleeping", "unloading")
# States whose memory is on the GPU (a sleeping vLLM has offloaded its weights to the CPU).
HOLDING = ("loading", "loaded", "unloading")


@dataclass(frozen=True, slots=True)
class TenantModel:
    """One model a server holds (or is loading, or unloading), as the server says."""

    name: str
    state: str  # one of STATES
    size_bytes: int | None = None  # the server's own figure; None when it does not say
    last_used_wall: float | None = None  # None: unknown (then the watchdog never evicts it)
    in_use: bool | None = None  # serving a request now; None: the server does not say
    pid: int | None = None  # the process that holds it, when the server runs one per model
    detail: str | None = None  # what the state means here, in words
    # Changes whenever the server served the model (Ollama's expires_at, llama-server's last
    # task ids): gpulock.tenants.usage turns a change into a last use the server never reports.
    fingerprint: str | None = None
    path: str | None = None  # its file, where the server says (llama-server's router): pre-warm


@dataclass(frozen=True, slots=True)
class Seen:
    """What one listing found: the kind the server says it is, and its models."""

    actual_kind: str
    models: tuple[TenantModel, ...] = ()
    free_bytes: int | None = None  # a server that reports its GPU (ComfyUI)
    total_bytes: int | None = None
    notes: tuple[str, ...] = field(default=())


class Adapter:
    """Base of the per-kind adapters: one tenant's client and the four operations."""

    kind: ClassVar[str] = ""
    can_load: ClassVar[bool] = True

    def __init__(self, spec: TenantSpec, *, timeout_s: float = 0.8) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.client = Client(spec.url or "", api_key_env=spec.api_key_env, timeout_s=timeout_s)

    def list(self) -> Seen:
        """The models the server holds now (TenantError when it cannot be asked)."""
        raise NotImplementedError

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        """Ask the server to free ``model``; returns what it answered, in words."""
        raise NotImplementedError

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        """Ask the server to load ``model`` (TenantError when this kind cannot).
        ``keep_alive_s``: how long to keep it loaded after, where the server takes a word on
        it (Ollama; a pre-warm asks for its predicted use and a margin)."""
        raise NotImplementedError

    def warm_up(self, model: str, *, timeout_s: float = 120.0) -> None:
        """After a load ahead: make the first real request as fast as the next ones, where the
        server's load alone does not (nothing to do for most kinds)."""

    def health(self) -> str | None:
        """None when the server answers as it should; else what is wrong."""
        from gpulock.tenants.http import TenantError

        try:
            self.list()
        except TenantError as e:
            return str(e)
        return None

    def freed(self, model: TenantModel | None) -> bool:
        """Whether a listing's entry for the model means its memory is back."""
        return model is None or model.state not in HOLDING
