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
* ``owner-<pid>-<start>.fifo`` -- the owner process's claim (``gpulock.claim``): its records
  are alive while the kernel holds it; a dead owner's records are recognisably dead, are
  cleaned by whoever finds them, and never count as used memory.
* ``owner-<pid>-<start>.sock`` -- the owner's control socket, served by a daemon thread, so a
  request is answered while the main thread is busy or asleep.

Eviction is a request, not a kill: the requester (``gpulock evict``, the watchdog, a waiter
that needs room) connects and asks; the owner waits until the model is not in use, unloads it
(its ``unload`` callable), removes the record and answers; the requester then checks that the
GPU's used memory really dropped.  Pinned models are refused unless the request is forced.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpulock import claim, devices, identity
from gpulock import settings as settings_mod
from gpulock.config import Config
from gpulock.errors import GpulockError
from gpulock.settings import Settings
from gpulock.state import atomic_write
from gpulock.units import format_size, parse_size

FORMAT = "gpulock.resident/1"
POLICIES = ("persistent", "cold-start", "pinned")
FOLDER = "residents"
MIN_ADMIT_RESERVE_BYTES = 800 * 1024**2  # CUDA context, driver and fragmentation headroom
VERIFY_S = 5.0  # how long a requester waits for freed memory to show (Ollama waits as long)


class ResidentError(GpulockError):
    """A resident model cannot be registered, used or evicted as asked."""


class Evicted(ResidentError):
    """The model was evicted and this handle has no ``load`` to bring it back."""


class AdmissionRefused(ResidentError):
    """Loading this much would eat into the GPU's reserve: refused before CUDA runs out."""

    def __init__(self, gpu: int, bytes_: int, free_bytes: int, reserve_bytes: int) -> None:
        self.gpu = gpu
        self.bytes = bytes_
        self.free_bytes = free_bytes
        self.reserve_bytes = reserve_bytes
        super().__init__(
            f"loading {format_size(bytes_)} on gpu{gpu} would leave "
            f"{format_size(max(free_bytes - bytes_, 0))} free, under the "
            f"{format_size(reserve_bytes)} reserve",
            hint="gpulock status shows what holds the memory; gpulock evict NAME frees idle models",
        )


@dataclass(frozen=True, slots=True)
class Record:
    """One model resident in VRAM, as the registry shows it to every process."""

    id: str
    name: str
    gpu: int
    owner: str  # "<pid>-<start ticks>": names the owner's claim and control socket
    pid: int
    uid: int
    user: str
    program: str
    policy: str
    loaded_wall: float
    last_used_wall: float
    start_ticks: int | None = None
    pidns: str | None = None
    declared_bytes: int | None = None
    measured_bytes: int | None = None
    in_use: bool = False
    uses: int = 0
    flush_every: int | None = None
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None
    ooms: int = 0  # out-of-memory errors the owner reported (a governor signal)

    @property
    def bytes(self) -> int | None:
        """Best known size: measured, else declared; None when nobody knows."""
        return self.measured_bytes if self.measured_bytes is not None else self.declared_bytes


def encode(r: Record) -> bytes:
    return json.dumps({"format": FORMAT, **asdict(r)}, separators=(",", ":")).encode()


def parse(data: bytes) -> Record:
    """A record from its file; ValueError for anything else (readers skip it)."""
    obj = json.loads(data)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError("not a resident record")
    known = {k: obj[k] for k in Record.__dataclass_fields__ if k in obj}
    r = Record(**known)
    if not (isinstance(r.id, str) and isinstance(r.pid, int) and isinstance(r.gpu, int)):
        raise ValueError("bad resident record")
    if r.policy not in POLICIES:
        raise ValueError(f"unknown policy {r.policy!r}")
    return r


# --- the folder ------------------------------------------------------------------------------


class Registry:
    """The files of ``<state>/residents``: the only code that reads or removes them."""

    def __init__(self, settings: Settings, *, create: bool = True) -> None:
        self.settings = settings
        if create:
            self.path = settings.state_dir / FOLDER
            from gpulock.state import ensure_subdir

            ensure_subdir(settings.state_dir, FOLDER, group=settings.group)
        else:
            self.path = settings.state_dir / FOLDER

    def claim_path(self, owner: str) -> Path:
        return self.path / f"owner-{owner}.fifo"

    def socket_path(self, owner: str) -> Path:
        return self.path / f"owner-{owner}.sock"

    def record_path(self, rid: str) -> Path:
        return self.path / f"{rid}.json"

    def records(self, *, clean: bool = True) -> list[Record]:
        """Live records (their owner holds its claim); dead ones are cleaned when ours to clean."""
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
        alive: dict[str, bool] = {}
        out = []
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                with open(self.path / name, "rb") as f:
                    r = parse(f.read(1 << 16))
            except (OSError, ValueError, TypeError):
                continue  # vanished or garbage: skipped, never a crash
            if name != f"{r.id}.json":
                continue
            if r.owner not in alive:
                alive[r.owner] = claim.held(self.claim_path(r.owner))
            if alive[r.owner]:
                out.append(r)
            elif clean:
                self._clean_dead(r)
        return out

    def _clean_dead(self, r: Record) -> None:
        if not identity.may_signal(r.uid):
            return
        try:
            os.unlink(self.record_path(r.id))
        except FileNotFoundError:
            return
        self.settings.emit(
            "cleanup",
            resident=r.id,
            name=r.name,
            gpu=r.gpu,
            pid=r.pid,
            declared_bytes=r.declared_bytes,
            reason="owner gone: no process holds its claim",
        )
        if not any(x.owner == r.owner for x in self.records(clean=False)):
            for p in (self.claim_path(r.owner), self.socket_path(r.owner)):
                with contextlib.suppress(OSError):
                    os.unlink(p)


def used_bytes(settings: Settings, gpu: int, *, registry: Registry | None = None) -> int:
    """Simulated used memory of a GPU: what live residents and current holders declare.

    Per process the larger of the two counts (a holder usually loads the model it declared as
    its need), so a model is not counted twice.
    """
    from gpulock.queuedir import QueueDir

    per_pid: dict[int, int] = {}
    for r in (registry or Registry(settings, create=False)).records(clean=False):
        if r.gpu == gpu and r.bytes:
            per_pid[r.pid] = per_pid.get(r.pid, 0) + r.bytes
    for t in QueueDir(settings, gpu, create=False).holders():
        need = t.need_bytes if t.need_bytes is not None else 0
        per_pid[t.pid] = max(per_pid.get(t.pid, 0), need)
    return sum(per_pid.values())


def probe_devices(settings: Settings) -> devices.DeviceReport:
    """The device report, with simulated GPUs' used memory taken from this registry."""
    return devices.probe(settings.config, used_by=lambda gpu: used_bytes(settings, gpu))


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
            if self.loaded:
                self._do_unload()
            self._owner.forget(self)
            self._load = None  # released for good: use() now says so

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
        self.sock = _listen(self.registry.socket_path(self.key))
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
                if not _peer_may_ask(conn, self.me.uid):
                    _send(conn, {"ok": False, "outcome": "refused", "detail": "not permitted"})
                    return
                req = json.loads(_recv_line(conn))
                with self.lock:
                    h = self.handles.get(str(req.get("id")))
                if req.get("op") != "evict" or h is None:
                    _send(conn, {"ok": False, "outcome": "unknown", "detail": "no such resident"})
                    return
                timeout_s = float(req.get("timeout_s", 10.0))
                reply = h._evict(
                    force=bool(req.get("force")),
                    timeout_s=timeout_s,
                    abandoned=lambda: _requester_left(conn),
                )
                _send(conn, reply)
            except Exception as e:  # an unload that raised: say so, keep serving
                with contextlib.suppress(OSError):
                    _send(conn, {"ok": False, "outcome": "error", "detail": repr(e)[:300]})


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


# --- the requester side ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvictResult:
    id: str
    name: str
    gpu: int
    pid: int
    outcome: str  # freed | unloaded | not-freed | refused | busy | no-answer | owner-gone | ...
    detail: str
    freed_bytes: int | None
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.outcome in ("freed", "unloaded", "owner-gone", "already-unloaded")


def find(settings: Settings, target: str, *, gpu: int | None = None) -> list[Record]:
    """Records whose id is ``target``, or whose model name is ``target``."""
    recs = Registry(settings).records()
    hits = [r for r in recs if r.id == target] or [r for r in recs if r.name == target]
    return [r for r in hits if gpu is None or r.gpu == gpu]


def evict(
    settings: Settings,
    record: Record,
    *,
    force: bool = False,
    timeout_s: float = 10.0,
    verify_s: float = VERIFY_S,
    reason: str = "requested",
    answer_s: float | None = None,
) -> EvictResult:
    """Ask the owner to unload ``record``; then check the GPU's memory came back.

    ``answer_s``: how long to wait for the owner's answer (default ``timeout_s`` + 5 s: the
    owner's own deadline, then time to unload).
    """
    start = time.monotonic()
    reg = Registry(settings)

    def result(outcome: str, detail: str, freed: int | None = None) -> EvictResult:
        res = EvictResult(
            record.id, record.name, record.gpu, record.pid, outcome, detail, freed,
            round(time.monotonic() - start, 6),
        )  # fmt: skip
        settings.emit(
            "evict", resident=record.id, name=record.name, gpu=record.gpu, pid=record.pid,
            outcome=outcome, detail=detail, freed_bytes=freed, elapsed_s=res.elapsed_s,
            force=force, reason=reason,
        )  # fmt: skip
        return res

    if not claim.held(reg.claim_path(record.owner)):
        reg.records()  # cleans it
        return result("owner-gone", "its owner had exited; record removed", record.bytes)
    before = _memory_of(settings, record)
    try:
        reply = _ask(
            reg.socket_path(record.owner),
            {"op": "evict", "id": record.id, "force": force, "timeout_s": timeout_s},
            timeout_s + 5.0 if answer_s is None else answer_s,
        )
    except TimeoutError:
        return result("no-answer", f"owner pid {record.pid} did not answer in {timeout_s:g} s")
    except OSError as e:
        if not claim.held(reg.claim_path(record.owner)):
            return result("owner-gone", "its owner exited meanwhile", record.bytes)
        return result("no-answer", f"control socket: {e.strerror or e}")
    if not reply.get("ok"):
        return result(str(reply.get("outcome", "refused")), str(reply.get("detail", "")))
    freed = _verify_freed(settings, record, before, verify_s)
    if freed is None:
        return result("unloaded", "unloaded; no memory probe to verify", reply.get("bytes"))
    if freed <= 0:
        return result("not-freed", "unloaded but memory not freed", 0)
    return result("freed", f"freed {format_size(freed)}", freed)


def _memory_of(settings: Settings, record: Record) -> int | None:
    """Memory the owner uses on the record's GPU: NVML per process, or the simulated count."""
    report = probe_devices(settings)
    dev = report.get(record.gpu)
    if dev is None:
        return None
    if dev.source == "simulated":
        return dev.used_bytes
    return devices.process_used_bytes(report, record.gpu, record.pid)


def _verify_freed(
    settings: Settings, record: Record, before: int | None, wait_s: float
) -> int | None:
    """Bytes that came back (None: cannot tell).  NVML lags an unload: poll up to ``wait_s``."""
    if before is None:
        return None
    deadline = time.monotonic() + wait_s
    pause = 0.01
    while True:
        after = _memory_of(settings, record)
        if after is None:
            return None
        if after < before or time.monotonic() >= deadline:
            return before - after
        time.sleep(pause)  # NVML has no notification: back off up to 0.2 s
        pause = min(pause * 2, 0.2)


def make_room(
    settings: Settings,
    gpu: int,
    need_bytes: int,
    *,
    exclude_pid: int,
    timeout_s: float = 10.0,
    reason: str = "room for a waiter",
) -> list[EvictResult]:
    """Evict idle, unpinned models of other processes until ``need_bytes`` are free.

    Victims in order of cost to the fleet: cold-start models before persistent ones (they
    expect to be reloaded), then least recently used first.  In-use and pinned models are
    never chosen.  ``timeout_s`` bounds the whole attempt, not each eviction.  Returns what
    was tried; nothing when the GPU's free memory is unknown.
    """
    dev = probe_devices(settings).get(gpu)
    if dev is None or dev.free_bytes is None or dev.free_bytes >= need_bytes:
        return []
    short = need_bytes - dev.free_bytes
    victims = sorted(
        (
            r
            for r in Registry(settings).records()
            if r.gpu == gpu and r.pid != exclude_pid and r.policy != "pinned" and not r.in_use
        ),
        key=lambda r: (r.policy != "cold-start", r.last_used_wall),
    )
    deadline = time.monotonic() + timeout_s  # for all of them: the waiter has a deadline
    silent: set[str] = set()  # owners that did not answer are not asked again
    results = []
    for r in victims:
        left = deadline - time.monotonic()
        if short <= 0 or left <= 0:
            break
        if r.owner in silent:
            continue
        res = evict(
            settings, r, timeout_s=left / 2, answer_s=left, verify_s=min(VERIFY_S, left),
            reason=reason,
        )  # fmt: skip
        results.append(res)
        if res.outcome == "no-answer":
            silent.add(r.owner)
        if res.ok:
            short -= res.freed_bytes or r.bytes or 0
    return results


def evict_named(
    target: str,
    *,
    gpu: int | None = None,
    force: bool = False,
    timeout: float | str = 10.0,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> list[EvictResult]:
    """``gpulock evict`` in Python: ask the owners of model ``target`` (a name or an id)."""
    from gpulock.units import parse_duration

    settings = settings_mod.load(config, state_dir)
    timeout_s = parse_duration(timeout, key="timeout")
    return [
        evict(settings, r, force=force, timeout_s=timeout_s)
        for r in find(settings, target, gpu=gpu)
    ]


def admit(
    bytes: int | str,
    gpu: int | None = None,
    *,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> int | None:
    """Refuse (AdmissionRefused) a load that would leave less than the reserve free.

    The reserve is max(800 MiB, the config's ``reserve``).  Returns the free bytes seen, or
    None when the GPU's memory is unknown (then nothing can be checked and the load goes on).
    """
    settings = settings_mod.load(config, state_dir)
    gpu_i = settings.config.default_gpu if gpu is None else gpu
    size = parse_size(bytes, key="bytes")
    dev = probe_devices(settings).get(gpu_i)
    if dev is None or dev.total_bytes is None or dev.free_bytes is None:
        return None
    reserve = max(MIN_ADMIT_RESERVE_BYTES, settings.config.reserve_bytes(dev.total_bytes))
    if dev.free_bytes - size < reserve:
        raise AdmissionRefused(gpu_i, size, dev.free_bytes, reserve)
    return dev.free_bytes


# --- the control socket ----------------------------------------------------------------------


def _short(path: Path) -> tuple[str, int | None]:
    """A path the kernel accepts for AF_UNIX (108 bytes): via /proc/self/fd when too long."""
    if len(os.fsencode(path)) < 100:
        return str(path), None
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{dfd}/{path.name}", dfd


def _listen(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    where, dfd = _short(path)
    try:
        s.bind(where)
        os.chmod(path, 0o600)
        s.listen(16)
    finally:
        if dfd is not None:
            os.close(dfd)
    return s


def _ask(path: Path, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    where, dfd = _short(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(where)
            _send(s, request)
            reply = json.loads(_recv_line(s))
    finally:
        if dfd is not None:
            os.close(dfd)
    if not isinstance(reply, dict):
        raise OSError("malformed answer")
    return reply


def _send(s: socket.socket, obj: dict[str, Any]) -> None:
    s.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(s: socket.socket, limit: int = 1 << 16) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise OSError("answer too long")
    return buf.split(b"\n", 1)[0]


def _requester_left(conn: socket.socket) -> bool:
    """True when the requester hung up (it gave up: no-answer); its request is void then."""
    import select

    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLRDHUP)
    gone = select.POLLHUP | select.POLLRDHUP | select.POLLERR
    return any(ev & gone for _, ev in poller.poll(0))


def _peer_may_ask(conn: socket.socket, owner_uid: int) -> bool:
    """Only the same user or root may ask (the folder's mode already keeps others out)."""
    import struct

    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
    except OSError:
        return False
    return uid in (0, owner_uid)
