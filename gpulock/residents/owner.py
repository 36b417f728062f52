"""The resident-model registry: every model a process keeps in VRAM, and eviction by request.

A process that keeps a model loaded between calls registers it::

    llm = Llama(model_path=..., n_gpu_layers=-1)
    h = gpulock.resident("qwen-7b", gpu=0, bytes="5GiB", model=llm, unload=adapters.unload_llama)
    with h.use() as model:          # marks it in use: an eviction waits until the call returns
        model.create_completion(...)

On disk, in ``<state>/residents/``:

* ``<id>.json`` -- one record per model (format ``gpulock.resident/1``, written atomically):
  owner identity, model name, GPU, declared and measured bytes, policy, loaded / last-used
  times, in-use flag, number of uses.
* ``owner-<pid>-<start>.fifo`` -- the owner process's claim (``gpulock.core.claim``): its records
  are alive while the kernel holds it; a dead owner's records are recognisably dead, are
  cleaned by whoever finds them, and never count as used memory.
* ``owner-<pid>-<start>.sock`` -- the owner's control socket, served by a daemon thread, so a
  request is answered while the main thread is busy or asleep.

Eviction is a request, not a kill: the requester (``gpulock evict``, the watchdog, a waiter
that needs room) connects and asks; the owner waits until the model is not in use, unloads it
(its ``unload`` callable), removes the record and answers; the requester then checks that the
GPU's used memory really dropped.  Pinned models are refused unless the request is forced.

This module is the owner's side; the requester's side is ``gpulock.residents.eviction`` and the wire
between them ``gpulock.residents.control``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from gpulock.core import claim, devices, identity, safejson
from gpulock.core import settings as settings_mod
from gpulock.core.config import Config
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.core.statefile import atomic_write
from gpulock.core.units import parse_size
from gpulock.residents import control
from gpulock.residents.registry import POLICIES, Record, Registry, encode


class ResidentError(GpulockError):
    """A resident model cannot be registered, used or evicted as asked."""


class Evicted(ResidentError):
    """The model was evicted and this handle has no ``load`` to bring it back."""


# --- the owner side --------------------------------------------------------------------------


class Resident:
    """A model this process keeps in VRAM.  Use it inside ``use()``; evictable between uses."""

    def __init__(
        self,
        owner: _Owner,
        record: Record,
        *,
        model: Any,
        load: Callable[[], Any] | None,
        unload: Callable[..., Any] | None,
        takes_model: bool,
    ) -> None:
        self._owner = owner
        self._record = record
        self._model = model
        self._load = load
        self._unload = unload
        self._takes_model = takes_model
        self._cond = threading.Condition()
        self._in_use = 0
        self._evicting = False
        self.loaded = True
        self.evictions = 0
        self.flushes = 0

    id = property(lambda self: self._record.id)
    name = property(lambda self: self._record.name)
    gpu = property(lambda self: self._record.gpu)
    policy = property(lambda self: self._record.policy)
    record = property(lambda self: self._record, doc="The record as last written.")

    @property
    def model(self) -> Any:
        return self._model

    @contextlib.contextmanager
    def use(self) -> Iterator[Any]:
        """Mark the model in use for one call; yields the model (reloaded if it was evicted)."""
        with self._cond:
            while self._evicting:
                self._cond.wait()
            if not self.loaded:
                if self._load is None:
                    raise Evicted(
                        f"resident {self.name!r} was evicted",
                        hint="load it again and register a new resident, or pass load=",
                    )
                self._model = self._load()
                self.loaded = True
                self._owner.adopt(self)
                self._owner.settings.emit(
                    "resident",
                    resident=self.id,
                    name=self.name,
                    gpu=self.gpu,
                    pid=self._record.pid,
                    declared_bytes=self._record.declared_bytes,
                    reloaded=True,
                )
            self._in_use += 1
            self._write(in_use=True, last_used_wall=time.time())
        try:
            yield self._model
        finally:
            with self._cond:
                self._in_use -= 1
                uses = self._record.uses + 1
                self._write(in_use=self._in_use > 0, last_used_wall=time.time(), uses=uses)
                every = self._record.flush_every
                if every and self._in_use == 0 and uses % every == 0:
                    self._flush()
                self._cond.notify_all()

    def update(self, *, measured_bytes: int | None = None, **torch_stats: int | None) -> None:
        """Report what was measured (bytes on the GPU; torch allocated / reserved)."""
        with self._cond:
            changes: dict[str, Any] = {}
            if measured_bytes is not None:
                changes["measured_bytes"] = measured_bytes
            for k in ("torch_allocated_bytes", "torch_reserved_bytes"):
                if torch_stats.get(k) is not None:
                    changes[k] = torch_stats[k]
            self._write(**changes)

    def report_oom(self) -> None:
        """Tell the governor this model's process ran out of GPU memory (it counts them)."""
        with self._cond:
            self._write(ooms=self._record.ooms + 1)
        self._owner.settings.emit("oom", resident=self.id, name=self.name, gpu=self.gpu)

    def report_torch(self, device_index: int | None = None) -> devices.TorchMemory | None:
        """Publish this process's torch allocated / reserved bytes on the record's GPU.

        The governor reads them as fragmentation (reserved - allocated).  ``device_index`` is
        torch's index when it differs from the record's GPU (``CUDA_VISIBLE_DEVICES``).
        """
        mem = devices.torch_memory(self.gpu if device_index is None else device_index)
        if mem is not None:
            self.update(
                torch_allocated_bytes=mem.allocated_bytes,
                torch_reserved_bytes=mem.reserved_bytes,
            )
        return mem

    def release(self) -> None:
        """Unload the model and remove it from the registry (idempotent)."""
        with self._cond:
            while self._in_use or self._evicting:
                self._cond.wait()
            was_loaded = self.loaded
            if self.loaded:
                self._do_unload()
            self._owner.forget(self)
            self._load = None  # released for good: use() now says so
        if was_loaded:
            # The report and the governor's history need the end of a residency, not only
            # its start: a cold-start model loads and unloads on every call.
            self._owner.settings.emit(
                "unload",
                resident=self.id,
                name=self.name,
                gpu=self.gpu,
                pid=self._record.pid,
                declared_bytes=self._record.declared_bytes,
            )

    def _write(self, **changes: Any) -> None:
        self._record = replace(self._record, **changes)
        if self.loaded:
            self._owner.write(self._record)

    def _do_unload(self) -> None:
        model, self._model = self._model, None
        self.loaded = False
        if self._unload is not None:
            if self._takes_model:
                self._unload(model)
            else:
                self._unload()
        self._owner.unpublish(self._record.id)

    def _flush(self) -> None:
        """Unload and reload: the blunt cure for fragmentation in long batch runs."""
        assert self._load is not None
        self._do_unload()
        self._model = self._load()
        self.loaded = True
        self.flushes += 1
        self._owner.adopt(self)
        self._owner.settings.emit(
            "flush", resident=self.id, name=self.name, gpu=self.gpu, uses=self._record.uses
        )

    def _evict(
        self, *, force: bool, timeout_s: float, abandoned: Callable[[], bool] = lambda: False
    ) -> dict[str, Any]:
        """Called by the control thread: unload at a safe point, or say why not.

        ``abandoned()`` says whether the requester gave up meanwhile: then nothing is done.
        """
        start = time.monotonic()
        with self._cond:
            if not self.loaded:
                return {"ok": True, "outcome": "already-unloaded"}
            if self.policy == "pinned" and not force:
                return {"ok": False, "outcome": "refused", "detail": "pinned (use --force)"}
            self._evicting = True
            try:
                deadline = start + timeout_s
                while self._in_use:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return {"ok": False, "outcome": "busy", "detail": "still in use"}
                    self._cond.wait(left)
                if abandoned():
                    return {"ok": False, "outcome": "abandoned", "detail": "requester left"}
                declared = self._record.bytes
                self._do_unload()
                self.evictions += 1
            finally:
                self._evicting = False
                self._cond.notify_all()
        return {
            "ok": True,
            "outcome": "unloaded",
            "bytes": declared,
            "unload_s": round(time.monotonic() - start, 6),
        }


class _Owner:
    """This process's claim, control socket and resident handles (one per process)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = Registry(settings)
        me = identity.current()
        self.me = me
        self.key = f"{me.pid}-{me.start_ticks or 0}"
        self.handles: dict[str, Resident] = {}
        self.counter = 0
        self.lock = threading.Lock()
        mode = settings.file_mode
        self.claim_fd = claim.create(self.registry.claim_path(self.key), mode)
        self.sock = control.listen(self.registry.socket_path(self.key))
        self.thread = threading.Thread(target=self._serve, name="gpulock-residents", daemon=True)
        self.thread.start()

    def new_id(self) -> str:
        with self.lock:
            self.counter += 1
            return f"{self.key}-{self.counter}"

    def adopt(self, h: Resident) -> None:
        with self.lock:
            self.handles[h.id] = h
        h._record = replace(h._record, loaded_wall=time.time(), in_use=h._in_use > 0)
        self.write(h._record)

    def forget(self, h: Resident) -> None:
        with self.lock:
            self.handles.pop(h.id, None)
        self.unpublish(h.id)

    def write(self, r: Record) -> None:
        atomic_write(self.registry.record_path(r.id), encode(r), mode=self.settings.file_mode)

    def unpublish(self, rid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.registry.record_path(rid))

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed (fork, shutdown)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30)
                if not control.peer_may_ask(conn, self.me.uid):
                    control.send(
                        conn, {"ok": False, "outcome": "refused", "detail": "not permitted"}
                    )
                    return
                req = safejson.loads(control.recv_line(conn))
                with self.lock:
                    h = self.handles.get(str(req.get("id")))
                if req.get("op") != "evict" or h is None:
                    control.send(
                        conn, {"ok": False, "outcome": "unknown", "detail": "no such resident"}
                    )
                    return
                timeout_s = float(req.get("timeout_s", 10.0))
                reply = h._evict(
                    force=bool(req.get("force")),
                    timeout_s=timeout_s,
                    abandoned=lambda: control.requester_left(conn),
                )
                control.send(conn, reply)
            except Exception as e:  # an unload that raised: say so, keep serving
                with contextlib.suppress(OSError):
                    control.send(conn, {"ok": False, "outcome": "error", "detail": repr(e)[:300]})


def _refusal(outcome: str, detail: str) -> dict[str, Any]:
    return {"ok": False, "outcome": outcome, "detail": detail}


_owner: _Owner | None = None
_owner_lock = threading.Lock()


def _get_owner(settings: Settings) -> _Owner:
    global _owner
    with _owner_lock:
        if _owner is None or _owner.settings.state_dir != settings.state_dir:
            _owner = _Owner(settings)
        return _owner


def _forget_owner_in_child() -> None:
    """A forked child owns none of its parent's models: drop the claim and the socket."""
    global _owner
    if _owner is not None:
        with contextlib.suppress(OSError):
            os.close(_owner.claim_fd)
        with contextlib.suppress(OSError):
            _owner.sock.close()
    _owner = None


os.register_at_fork(after_in_child=_forget_owner_in_child)


def resident(
    name: str,
    *,
    gpu: int | None = None,
    bytes: int | str | None = None,
    unload: Callable[..., Any] | None = None,
    policy: str = "persistent",
    model: Any = None,
    load: Callable[[], Any] | None = None,
    flush_every: int | None = None,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> Resident:
    """Register a model this process keeps in VRAM; returns its handle.

    ``unload`` frees it: called with the model when ``model`` or ``load`` is given, else with
    no argument.  ``load`` (optional) brings it back after an eviction and is required for
    ``flush_every=N`` (unload and reload every N uses).  ``policy``: ``persistent`` (evictable
    when idle), ``cold-start`` (evicted first), ``pinned`` (only a forced eviction).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if flush_every is not None and (flush_every < 1 or load is None):
        raise ValueError("flush_every needs a whole number >= 1 and a load= callable")
    settings = settings_mod.load(config, state_dir)
    gpu_i = settings.config.default_gpu if gpu is None else gpu
    declared = None if bytes is None else parse_size(bytes, key="bytes")
    if model is None and load is not None:
        model = load()
    owner = _get_owner(settings)
    now = time.time()
    me = owner.me
    record = Record(
        id=owner.new_id(),
        name=name,
        gpu=gpu_i,
        owner=owner.key,
        pid=me.pid,
        uid=me.uid,
        user=me.user,
        program=_program(),
        policy=policy,
        loaded_wall=now,
        last_used_wall=now,
        start_ticks=me.start_ticks,
        pidns=me.pidns,
        declared_bytes=declared,
        flush_every=flush_every,
    )
    h = Resident(
        owner,
        record,
        model=model,
        load=load,
        unload=unload,
        takes_model=model is not None or load is not None,
    )
    owner.adopt(h)
    settings.emit(
        "resident", resident=record.id, name=name, gpu=gpu_i, pid=me.pid, declared_bytes=declared
    )
    return h


def _program() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python"
