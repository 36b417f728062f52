"""``gpulock pool``: as many workers of one command as the GPU's line admits, and no more.

Each worker holds its own ticket with the pool's ``need``, taken through the public
``gpulock.acquire_async``, so the lock's sharing rule decides how many run at once (needs plus
the reserve within the GPU's size, FIFO kept, exclusive tickets respected).  With ``--gpu any``
(or a set) each worker's ticket waits for every GPU of the set and runs on whichever admits it
first, the GPUs where the pool's earlier workers run preferred (their model is warm there).
The pool runs on one asyncio loop, and:

* while fewer than ``max`` workers run, exactly one more ticket waits in line (never two, so a
  pool never crowds other jobs out of the line); when it is granted, a worker starts with it;
* a worker inherits its ticket's claim descriptor (as ``gpulock run``'s command does), so the
  GPU stays claimed while it lives even if the pool is killed;
* a worker that exits 0 has done its share: the waiting ticket leaves the line, no worker
  starts any more, and the pool ends when the others have;
* a worker that fails is replaced after a back-off (``gpulock.pool.policy``) until more than
  ``retries`` fail in a row: then the others get SIGTERM and the pool fails, naming the worker;
* SIGTERM, SIGHUP and SIGINT leave the line and reach every worker (SIGINT from the terminal
  already reached the whole group); the pool exits 128+N once they have ended.

Signal handlers run on the loop (``add_signal_handler``), between two steps of the pool, so a
signal never lands between a grant and the bookkeeping of it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpulock.api import acquire_async
from gpulock.core import devices
from gpulock.core.errors import GpulockError, LockTimeout
from gpulock.core.settings import Settings
from gpulock.lock.gpuset import GpuArg, budget_of, gpu_set
from gpulock.lock.inherit import ENV_TICKET
from gpulock.lock.lease import Lease
from gpulock.pool import ENV_SIZE, ENV_WORKER, policy, record
from gpulock.runner import command_env, terminal_delivers

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class PoolFailed(GpulockError):
    """Too many workers failed in a row; ``exit_code`` is the last one's, as a shell reads it."""

    def __init__(self, worker: int, returncode: int, failures: int) -> None:
        self.worker = worker
        self.returncode = returncode
        self.failures = failures
        self.exit_code = policy.exit_code(returncode)
        super().__init__(
            f"worker {worker} failed ({policy.exit_reason(returncode)}); "
            f"{failures} failure(s) in a row, the pool stopped",
            hint="--retries N replaces more failed workers; 'gpulock history' shows each exit",
        )


@dataclass
class Worker:
    index: int
    lease: Lease
    proc: asyncio.subprocess.Process
    started_at: float


@dataclass(frozen=True, slots=True)
class PoolSpec:
    command: tuple[str, ...]
    need_bytes: int
    max_workers: int
    min_workers: int = 1
    retries: int = 3
    gpu: GpuArg = None  # an index, a set or "any" (default: the config's default_gpu)
    name: str | None = None
    timeout_s: float | None = None


@dataclass
class Pool:
    """One pool's state; ``run()`` drives it to the end and returns the exit code."""

    settings: Settings
    spec: PoolSpec
    clock: Callable[[], float] = time.monotonic
    running: dict[int, Worker] = field(default_factory=dict)
    held: list[Lease] = field(default_factory=list)  # granted, waiting for --min to start
    ask: asyncio.Task[None] | None = None
    leaving: set[asyncio.Task[None]] = field(default_factory=set)  # cancelled asks
    watching: set[asyncio.Task[None]] = field(default_factory=set)  # one per running worker
    events: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    started_any: bool = False
    done: bool = False  # a worker exited 0
    stop_signal: int | None = None
    failed: PoolFailed | None = None
    late_failure: PoolFailed | None = None  # a worker failed after another finished
    streak: int = 0
    backoff_until: float = 0.0
    workers_started: int = 0

    @property
    def name(self) -> str:
        return self.spec.name or os.path.basename(self.spec.command[0])

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs its workers may run on: one, or a set (``--gpu any``, ``--gpu 0,2``)."""
        return gpu_set(self.settings.config, self.spec.gpu)

    @property
    def gpu(self) -> int:
        return self.gpus[0]

    @property
    def finishing(self) -> bool:
        return self.done or self.stop_signal is not None or self.failed is not None

    # -- the loop --

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._emit("pool-start", command=list(self.spec.command))
        self._publish()
        rc: int | None = None
        try:
            rc = await self._loop()
            return rc
        finally:
            await self._leave_line()
            for w in list(self.running.values()):  # only after an unexpected error
                self._signal(w, signal.SIGTERM)
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)  # leaves the default: put the caller's back
                signal.signal(sig, previous[sig])
            record.remove(self.settings)
            self._emit("pool-end", rc=rc, workers_started=self.workers_started)

    async def _loop(self) -> int:
        while True:
            now = self.clock()
            if policy.may_ask(
                running=len(self.running),
                held=len(self.held),
                max_workers=self.spec.max_workers,
                asking=self.ask is not None,
                finishing=self.finishing,
                backoff_until=self.backoff_until,
                now=now,
            ):
                self.ask = asyncio.create_task(self._acquire())
            if self.finishing and not self.running and self.ask is None:
                return self._result()
            wait_s = None
            if self.ask is None and not self.finishing and self.backoff_until > now:
                wait_s = self.backoff_until - now
            try:
                ev = await asyncio.wait_for(self.events.get(), wait_s)
            except TimeoutError:
                continue  # the back-off is over: ask again
            await self._handle(ev)

    def _result(self) -> int:
        if self.failed is not None:
            raise self.failed
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        if self.late_failure is not None:
            raise self.late_failure
        return 0

    async def _handle(self, ev: tuple[Any, ...]) -> None:
        kind = ev[0]
        if kind in ("granted", "timeout", "error") and self.ask is None:
            if kind == "granted":  # the answer of an ask cancelled just after its grant
                await self._granted(ev[1])
            return
        if kind == "granted":
            self.ask = None
            await self._granted(ev[1])
        elif kind == "timeout" or kind == "error":
            self.ask = None
            raise ev[1]
        elif kind == "exit":
            self._exited(ev[1], ev[2])
        # "wake": nothing to do but look again

    async def _acquire(self) -> None:
        """Wait in line for one more worker's ticket and post the outcome to the loop."""
        timeout = None
        if not self.started_any and self.spec.timeout_s is not None:
            timeout = max(self.deadline - self.clock(), 0.0)
        # On a set of GPUs: where earlier workers run, their model is warm (gpulock.lock.queue).
        warm = {w.lease.gpu: f"earlier workers of pool {self.name}" for w in self.running.values()}
        try:
            lease = await acquire_async(
                self.spec.gpu,
                self.spec.need_bytes,
                timeout,
                self.name,
                config=self.settings.config,
                state_dir=str(self.settings.state_dir),
                command=self.spec.command,
                prefer=warm or None,
            )
        except LockTimeout as e:
            self.events.put_nowait(("timeout", e))
        except Exception as e:  # NeedTooLarge, an unusable state folder...: the loop raises it
            self.events.put_nowait(("error", e))
        else:
            if lease.inherited:  # inside `gpulock run`: every ask would get that one lease
                self.events.put_nowait(("error", _nested(lease)))
                return
            self.events.put_nowait(("granted", lease))

    async def _granted(self, lease: Lease) -> None:
        if self.finishing:
            lease.release()
            return
        self.held.append(lease)
        if not self.started_any and len(self.held) < self.spec.min_workers:
            self._publish()
            return
        self.started_any = True
        while self.held and not self.finishing:
            await self._start(self.held.pop(0))
        self._publish()

    async def _start(self, lease: Lease) -> None:
        index = min(set(range(len(self.running) + 1)) - set(self.running))
        size = len(self.running) + 1
        env = command_env(lease, self.settings)
        env[ENV_WORKER] = str(index)
        env[ENV_SIZE] = str(size)
        fds = lease.claim_fds
        try:
            proc = await asyncio.create_subprocess_exec(*self.spec.command, env=env, pass_fds=fds)
        except OSError as e:
            lease.release()
            raise GpulockError(f"cannot run {self.spec.command[0]}: {e.strerror}") from None
        lease.set_child(proc.pid)
        w = Worker(index, lease, proc, self.clock())
        self.running[index] = w
        self.workers_started += 1
        self._emit(
            "pool-worker",
            action="start",
            worker=index,
            worker_pid=proc.pid,
            ticket=lease.ticket,
            worker_gpus=list(lease.gpus),
            size=size,
            waited_s=round(lease.waited_s, 6),
        )
        watch = asyncio.get_running_loop().create_task(self._watch(w))
        self.watching.add(watch)  # a task nobody references may be collected mid-wait
        watch.add_done_callback(self.watching.discard)
        if self.stop_signal is not None:  # came while it started: it gets it now
            self._signal(w, self.stop_signal)

    async def _watch(self, w: Worker) -> None:
        rc = await w.proc.wait()
        self.events.put_nowait(("exit", w.index, rc))

    def _exited(self, index: int, rc: int) -> None:
        w = self.running.pop(index)
        ran_s = self.clock() - w.started_at
        self._emit(
            "pool-worker",
            action="exit",
            worker=index,
            worker_pid=w.proc.pid,
            ticket=w.lease.ticket,
            rc=rc,
            reason=policy.exit_reason(rc),
            ran_s=round(ran_s, 6),
        )
        w.lease.release()  # after the event: history reads "exit", then "release"
        if rc == 0:
            if not self.done:
                self.done = True
                self._cancel_ask()
                self._release_held()
        elif self.stop_signal is None and self.failed is None:
            self.streak = policy.next_streak(self.streak, ran_s)
            if self.done:
                self.late_failure = self.late_failure or PoolFailed(index, rc, self.streak)
            elif policy.gives_up(self.streak, self.spec.retries):
                self.failed = PoolFailed(index, rc, self.streak)
                self._cancel_ask()
                self._release_held()
                for other in self.running.values():
                    self._signal(other, signal.SIGTERM)
            else:
                self.backoff_until = self.clock() + policy.backoff_s(self.streak)
        self._publish()

    # -- stopping --

    def _on_signal(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self._cancel_ask()
            self._release_held()
        from_tty = signum == signal.SIGINT and terminal_delivers()
        for w in self.running.values():
            if not from_tty:
                self._signal(w, signum)
        self.events.put_nowait(("wake",))

    def _cancel_ask(self) -> None:
        """Leave the line: cancelling the waiting ``acquire_async`` removes its ticket."""
        if self.ask is not None:
            self.ask.cancel()
            self.leaving.add(self.ask)
            self.ask = None

    def _release_held(self) -> None:
        for lease in self.held:
            lease.release()
        self.held.clear()

    async def _leave_line(self) -> None:
        self._cancel_ask()
        if self.leaving:
            await asyncio.gather(*self.leaving, return_exceptions=True)
        self.leaving.clear()
        # A grant posted before the cancel landed: give it back.
        while not self.events.empty():
            ev = self.events.get_nowait()
            if ev[0] == "granted":
                ev[1].release()
        self._release_held()

    def _signal(self, w: Worker, signum: int) -> None:
        try:
            w.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    # -- what others see --

    @property
    def deadline(self) -> float:
        assert self.spec.timeout_s is not None
        return self._start_at + self.spec.timeout_s

    def __post_init__(self) -> None:
        self._start_at = self.clock()

    def _emit(self, event: str, **fields: Any) -> None:
        where = {"gpu_set": list(self.gpus)} if len(self.gpus) > 1 else {}
        self.settings.emit(
            event,
            gpu=self.gpu,
            **where,
            pid=os.getpid(),
            name=self.name,
            need_bytes=self.spec.need_bytes,
            max=self.spec.max_workers,
            **fields,
        )

    def _publish(self) -> None:
        record.write(
            self.settings,
            {
                "name": self.name,
                "gpu": self.gpu,
                "gpus": list(self.gpus),
                "need_bytes": self.spec.need_bytes,
                "max": self.spec.max_workers,
                "min": self.spec.min_workers,
                "workers": [
                    {
                        "index": w.index,
                        "pid": w.proc.pid,
                        "ticket": w.lease.ticket,
                        "gpus": list(w.lease.gpus),
                    }
                    for w in sorted(self.running.values(), key=lambda w: w.index)
                ],
                "started_wall": time.time() - (self.clock() - self._start_at),
            },
        )


def max_for(settings: Settings, gpu: GpuArg, need_bytes: int) -> int:
    """``--max`` left out: as many as the GPU's budget could ever hold (on a set of GPUs, as
    many as all of theirs could)."""
    out = 0
    for g in gpu_set(settings.config, gpu):
        budget = budget_of(settings.config, devices.total_bytes(g, settings.config))
        out += policy.default_max(budget, need_bytes)
    return out


def run_pool(settings: Settings, spec: PoolSpec) -> int:
    """Run the pool to its end: 0 when the work is done, 128+N after signal N; raises
    ``LockTimeout`` (no worker granted within ``timeout_s``) or ``PoolFailed``."""
    return asyncio.run(Pool(settings, spec).run())


def _nested(lease: Lease) -> GpulockError:
    return GpulockError(
        f"gpulock pool runs inside a lease on gpu{lease.gpu} (ticket {lease.ticket}, from "
        f"${ENV_TICKET}): its workers would all share that one ticket",
        hint="start gpulock pool outside 'gpulock run', so each worker holds its own ticket",
    )


__all__: Sequence[str] = ("ENV_SIZE", "ENV_WORKER", "Pool", "PoolFailed", "PoolSpec", "run_pool")
