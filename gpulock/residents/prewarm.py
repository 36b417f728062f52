"""Pre-warm, the acting side: models confidently needed soon start warm.

``Prewarmer.tick(now)`` is one look, driven by the governor's loop (the one long-running
process every machine with foresight may run; ``gpulock governor --once`` from cron does it
too, and waits for what it started).  The decision is ``gpulock.core.prewarm.plan`` (pure);
this module gathers its inputs and carries it out:

* **candidates**: every model the past knows where to get (``foresight_past.Where``: its
  file from ``model-load`` events, its tenant from ``resident`` and ``call`` events) that is
  not loaded now, with its next use (the line, the crontab, running fleets, the history);
* **page-cache**: a background thread reads the file at idle I/O priority, 8 MiB at a time,
  skipping chunks already cached (``mincore``); before every chunk it looks at the GPU lines
  and stops the moment a ticket holds or waits anywhere (a pre-warm yields to every real
  job), and when ``MemAvailable`` no longer holds the rest times the margin;
* **load**: a background thread asks the tenant (Ollama: ``POST /api/generate`` without a prompt
  and a ``keep_alive`` that outlasts the predicted use; llama-server's router ``POST
  /models/load``; llama-swap's upstream health; vLLM's ``wake_up``) to load the model.  A
  server's load cannot be interrupted halfway; instead a model loaded ahead is the first
  victim whenever room is needed, until its job has used it (``loaded_ahead``, read by
  ``gpulock.residents.eviction``), and only the tenant of the job's own agent keeps it.

Each action ends in one ``prewarm`` event with the prediction that caused it (``next_use_s``,
``next_use_source``, ``next_use_by``, ``confidence``) and its outcome.  What is warming now,
and why, is published in ``<state>/prewarm.json`` (format ``gpulock.prewarm/1``, written
atomically; ``gpulock.residents.prewarm_state``) for ``gpulock status`` and eviction.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpulock.core import foresight as fs
from gpulock.core import pagecache, statefile
from gpulock.core import prewarm as pw
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.residents.prewarm_state import FORMAT, PUBLISHED, published, used_since

CHUNK_BYTES: Final = 8 << 20
LOAD_TIMEOUT_S: Final = 600.0  # a server's load of a large model from a cold disk
KEEP_ALIVE_AFTER_S: Final = 300.0  # Ollama keeps a model loaded ahead this long past its use
PUBLISH_EVERY_S: Final = 1.0
LIST_EVERY_S: Final = 0.1  # how often a load ahead looks whether the server lists it loaded


@dataclass(slots=True)
class _Job:
    """One action under way or done, as published."""

    warm: pw.Warm
    started_wall: float
    state: str  # warming | loading | warm | loaded | stopped | failed
    lead_s: float = 120.0
    bytes_total: int | None = None
    bytes_done: int = 0
    bytes_read: int = 0
    done_wall: float | None = None
    reason: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def entry(self, now_wall: float) -> dict[str, Any]:
        w = self.warm
        return {
            "model": w.model,
            "how": w.how,
            "state": self.state,
            "path": w.path,
            "tenant": w.tenant,
            "gpu": w.gpu,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "started_wall": round(self.started_wall, 3),
            "done_wall": None if self.done_wall is None else round(self.done_wall, 3),
            "reason": self.reason,
            "until_wall": round(w.next_use_wall + self.lead_s, 3),  # then it is over
            **w.why(now_wall),
        }


def busy_gpus(settings: Settings) -> frozenset[int]:
    """GPUs on which a live ticket holds or waits."""
    from gpulock.lock.census import queue_gpus
    from gpulock.lock.queuedir import QueueDir

    out = set()
    for gpu in queue_gpus(settings):
        qdir = QueueDir(settings, gpu, create=False)
        if any(qdir.alive(seq) for seq in qdir.seqs()):
            out.add(gpu)
    return frozenset(out)


class Prewarmer:
    """The pre-warm loop's state: what runs, what was loaded ahead, the disk's last reading.

    Owned by one governor; its threads are the only other parties and meet it under
    ``_lock``.  ``adapter_for``: the tenant adapters (``gpulock.tenants.survey.adapter_for``
    by default); ``on_chunk``: called after each chunk a page-cache read brought in (a test
    starts a job there, to see the read stop at the next chunk).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        adapter_for: Callable[..., Any] | None = None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._adapter_for = adapter_for
        self._on_chunk = on_chunk  # after each chunk read (bytes so far): the world may change
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._skips: list[pw.Skip] = []
        self._disk: dict[int, tuple[int, float]] = {}  # st_dev -> (io ticks ms, monotonic s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._published_at = 0.0
        self._wrote = False  # nothing to say is not written, until something was
        self._adopted = False
        self._lead_s = pw.Options().lead_s

    # --- one look -------------------------------------------------------------------------

    def tick(
        self,
        now_wall: float,
        *,
        resident: Iterable[str],
        free_bytes: Mapping[int, int | None] | None,
    ) -> list[pw.Warm]:
        """Plan and start what is due.  ``resident``: the names of the models loaded now (any
        GPU); ``free_bytes``: each GPU's free memory less its reserve (None: unknown)."""
        opts = pw.options(self.settings.config)
        self._lead_s = opts.lead_s
        loaded = set(resident)
        if not opts.enabled:
            self._publish(now_wall, force=True)
            return []
        from gpulock.residents.foresight_past import read_past

        past = read_past(self.settings.state_dir, mode=self.settings.file_mode)
        if not self._adopted:  # a governor run from cron: the last one's loads ahead count
            self._adopted = True
            self._adopt(now_wall)
        self._retire(past, loaded, now_wall, opts)
        cands = self.candidates(past, loaded, now_wall, opts)
        with self._lock:
            warming = frozenset(k for k, j in self._jobs.items() if j.thread is not None
                                and j.thread.is_alive())  # fmt: skip
        world = pw.World(
            now_wall,
            pagecache.mem_available_bytes(),
            self._disk_busy(cands),
            busy_gpus(self.settings),
            free_bytes,
            warming,
        )
        warms, skips = pw.plan(cands, world, opts)
        with self._lock:
            self._skips = skips
        for w in warms:
            self._start(w, now_wall, opts)
        self._publish(now_wall, force=True)
        return warms

    def candidates(
        self, past: Any, loaded: set[str], now_wall: float, opts: pw.Options
    ) -> list[pw.Candidate]:
        """The models not loaded now whose source is known, each with its next use (and, for
        those due, how much of their file is cached)."""
        from gpulock.residents import foresight_inputs as fi

        known = {m: w for m, w in past.where.items() if m not in loaded}
        if not known:
            return []
        gpus = sorted({w.gpu for w in known.values() if w.gpu is not None})
        planned = fi.plans(self.settings, past, gpus, now_wall)
        nexts = fs.next_uses(
            known, planned, past.uses, now_wall, utc_offset_s=float(fi.local_offset_s(now_wall))
        )
        tenants = {s.name: s for s in self.settings.config.tenants}
        out = []
        for m, w in sorted(known.items()):
            spec = tenants.get(w.tenant) if w.tenant else None
            tenant = w.tenant if spec is not None and spec.kind != "command" else None
            c = pw.Candidate(
                m, nexts[m], w.bytes, None, None, None, tenant,
                spec.gpu if spec is not None else w.gpu,
            )  # fmt: skip
            if w.path and pw.due(c, now_wall, opts):
                size, frac = file_state(w.path)
                if size is not None:
                    c = pw.Candidate(m, nexts[m], w.bytes, w.path, size, frac, tenant, c.gpu)
            out.append(c)
        return out

    # --- acting ---------------------------------------------------------------------------

    def _start(self, w: pw.Warm, now_wall: float, opts: pw.Options) -> None:
        job = _Job(w, now_wall, "warming" if w.how == "page-cache" else "loading", opts.lead_s)
        target = self._read if w.how == "page-cache" else self._load
        job.thread = threading.Thread(
            target=target, args=(job, opts), name=f"gpulock-prewarm-{w.how}", daemon=True
        )
        with self._lock:
            self._jobs[(w.model, w.how)] = job
        job.thread.start()

    def _read(self, job: _Job, opts: pw.Options) -> None:
        """Read ``job``'s file into the page cache; stop at the first ticket."""
        start = time.monotonic()
        path = job.warm.path or ""
        try:
            pagecache.be_idle()
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self._end(job, "failed", f"cannot open: {e.strerror}", start)
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._end(job, "failed", "not a regular file", start)
                return
            size = st.st_size
            job.bytes_total = size
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            cached = pagecache.chunk_residency(fd, size, CHUNK_BYTES)
            buf = bytearray(CHUNK_BYTES)
            view = memoryview(buf)
            for i, offset in enumerate(range(0, size, CHUNK_BYTES)):
                n = min(CHUNK_BYTES, size - offset)
                if cached is not None and cached[i] >= n:
                    job.bytes_done += n
                    continue
                why = self._yield_reason(size - job.bytes_done, opts)
                if why is not None:
                    self._end(job, "stopped", why, start)
                    return
                got = os.preadv(fd, [view[:n]], offset)
                if got <= 0:
                    break
                job.bytes_done += got
                job.bytes_read += got
                self._publish(self.clock())
                if self._on_chunk is not None:
                    self._on_chunk(job.bytes_read)
            self._end(job, "warm", None, start)
        except OSError as e:
            self._end(job, "failed", f"read: {e.strerror or e}", start)
        finally:
            os.close(fd)

    def _yield_reason(self, left_bytes: int, opts: pw.Options) -> str | None:
        """Why the page-cache read must stop now, or None to go on."""
        if self._stop.is_set():
            return "the governor stops"
        if busy_gpus(self.settings):
            return "a job holds or waits for a GPU"
        mem = pagecache.mem_available_bytes()
        if mem is None or mem < left_bytes * opts.margin:
            return "low memory"
        return None

    def _load(self, job: _Job, opts: pw.Options) -> None:
        """Ask the tenant to load ``job``'s model ahead."""
        start = time.monotonic()
        w = job.warm
        try:
            from gpulock.tenants.survey import adapter_for, find_spec

            spec = find_spec(self.settings, w.tenant or "")
            make = self._adapter_for or adapter_for
            adapter = make(spec, self.settings, timeout_s=LOAD_TIMEOUT_S)
            keep = max(w.next_use_wall - self.clock(), 0.0) + KEEP_ALIVE_AFTER_S
            adapter.load(w.model, timeout_s=LOAD_TIMEOUT_S, keep_alive_s=keep)
            # Some servers answer before the model is in (llama-server's router starts a
            # child): it is loaded when its listing says so, as an eviction is verified.
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while not self._listed(adapter, w.model):
                if time.monotonic() > deadline or self._stop.wait(LIST_EVERY_S):
                    self._end(job, "failed", "never listed as loaded", start)
                    return
            if not busy_gpus(self.settings):  # its first request, ahead: never beside a job
                adapter.warm_up(w.model, timeout_s=LOAD_TIMEOUT_S)
        except GpulockError as e:  # TenantError: a server that is down or refuses
            self._end(job, "failed", str(e)[:300], start)
            return
        job.bytes_total = job.bytes_done = w.bytes or 0
        self._end(job, "loaded", None, start)

    @staticmethod
    def _listed(adapter: Any, model: str) -> bool:
        """Whether the tenant lists ``model`` as loaded (a listing that fails: not yet)."""
        try:
            seen = adapter.list()
        except GpulockError:
            return False
        return any(m.name == model and m.state == "loaded" for m in seen.models)

    def _end(self, job: _Job, outcome: str, reason: str | None, start: float) -> None:
        w = job.warm
        now = self.clock()
        with self._lock:
            job.state = outcome
            job.reason = reason
            job.done_wall = now
        where = {"path": w.path} if w.how == "page-cache" else {"tenant": w.tenant}
        self.settings.emit(
            "prewarm", model=w.model, how=w.how, outcome=outcome, reason=reason, gpu=w.gpu,
            **where, bytes=job.bytes_total, bytes_read=job.bytes_read,
            elapsed_s=round(time.monotonic() - start, 6), **w.why(now),
        )  # fmt: skip
        self._publish(now, force=True)

    def _retire(self, past: Any, loaded: set[str], now_wall: float, opts: pw.Options) -> None:
        """Forget what is over: a finished action whose use has come (or passed by a lead), a
        model loaded ahead that was used or is gone."""
        with self._lock:
            for key, job in list(self._jobs.items()):
                if job.thread is not None and job.thread.is_alive():
                    continue
                w = job.warm
                late = now_wall > w.next_use_wall + opts.lead_s
                if job.state == "loaded":
                    if late or w.model not in loaded or used_since(past, w.model, job.done_wall):
                        del self._jobs[key]
                elif late or now_wall > (job.done_wall or now_wall) + opts.lead_s:
                    del self._jobs[key]

    def _adopt(self, now_wall: float) -> None:
        """The finished actions the last governor published, still within their time."""
        doc = published(self.settings, now_wall)
        for e in doc["entries"] if doc is not None else ():
            try:
                w = pw.Warm(
                    str(e["model"]), str(e["how"]), float(e["next_use_wall"]),
                    str(e["next_use_source"]), str(e.get("next_use_by") or ""),
                    float(e["confidence"]), e.get("path"), e.get("tenant"), e.get("gpu"),
                    e.get("bytes_total"),
                )  # fmt: skip
                job = _Job(w, float(e["started_wall"]), str(e["state"]),
                           float(e["until_wall"]) - w.next_use_wall)  # fmt: skip
                job.done_wall = float(e["done_wall"])
            except (KeyError, TypeError, ValueError):
                continue
            job.bytes_total, job.bytes_done = e.get("bytes_total"), int(e.get("bytes_done") or 0)
            with self._lock:
                self._jobs.setdefault((w.model, w.how), job)
        self._wrote = self._wrote or doc is not None

    def _disk_busy(self, cands: list[pw.Candidate]) -> float | None:
        """How busy the disk of the soonest file to warm was since the last look."""
        files = [c for c in cands if c.path is not None and c.next_use.at_wall is not None]
        first = min(files, key=lambda c: c.next_use.at_wall or 0.0, default=None)
        if first is None or first.path is None:
            return None
        try:
            dev = os.stat(first.path).st_dev
        except OSError:
            return None
        ticks, now = pagecache.io_ticks_ms(dev), time.monotonic()
        if ticks is None:
            return None
        before = self._disk.get(dev)
        self._disk[dev] = (ticks, now)
        if before is None or now - before[1] <= 0:
            return None
        return min(max((ticks - before[0]) / 1000.0 / (now - before[1]), 0.0), 1.0)

    # --- life -----------------------------------------------------------------------------

    def wait(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the actions under way: a ``--once`` pass ends warm."""
        deadline = time.monotonic() + timeout_s
        for job in list(self._jobs.values()):
            if job.thread is not None:
                job.thread.join(max(deadline - time.monotonic(), 0.0))

    def stop(self) -> None:
        """Stop the page-cache reads now (a server's load goes on: it is the server's)."""
        self._stop.set()
        for job in list(self._jobs.values()):
            if job.thread is not None and job.warm.how == "page-cache":
                job.thread.join(2.0)

    def _publish(self, now_wall: float, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._published_at < PUBLISH_EVERY_S:
            return
        self._published_at = time.monotonic()
        with self._lock:
            if not self._wrote and not self._jobs and not self._skips:
                return
            self._wrote = True
            doc = {
                "format": FORMAT,
                "pid": os.getpid(),
                "updated_wall": round(now_wall, 3),
                "lead_s": self._lead_s,
                "entries": [j.entry(now_wall) for j in self._jobs.values()],
                "waiting": [
                    {"model": s.model, "how": s.how, "reason": s.reason} for s in self._skips
                ],
            }
        try:
            statefile.atomic_write(
                self.settings.state_dir / PUBLISHED,
                json.dumps(doc, separators=(",", ":")).encode(),
                mode=self.settings.file_mode,
            )
        except (OSError, GpulockError):
            pass  # status shows less; the warming goes on


def file_state(path: str) -> tuple[int | None, float | None]:
    """(size, share in the page cache) of a regular file; (None, None) when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            return None, None
        got = pagecache.resident_bytes(fd, 0, st.st_size)
        return st.st_size, None if got is None else got / st.st_size
    except OSError:
        return None, None
    finally:
        os.close(fd)
