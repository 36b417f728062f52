"""What the governor measures each pass: GPUs, residents, host memory pressure, swap, OOMs.

``Probe.collect(now_wall)`` returns one ``Snapshot`` (``governor.model``) for the pure policy.
Every reader of the world is injected through the constructor, real ones by default, so a test
can script PSI text or swap counters without patching modules:

* GPUs and residents: ``gpulock.arbiter.residents`` (NVML, or simulated GPUs whose used
  memory is what live residents, tenant models and holders declare; library residents and the
  tenants' models in one list); a resident's owner "holds the lock"
  when its pid is the pid or the command pid (``gpulock run``) of a live holding ticket.
* Host memory pressure: ``/proc/pressure/memory`` (PSI, Linux 4.20+), ``some`` and ``full``
  avg10.  A kernel without PSI, or one booted with ``psi=0``, gives None, never 0.
* Swap: psutil's cumulative swap-in and swap-out bytes; the rate needs two samples, so the
  first pass says None.
* OOMs: the increase of the residents' ``ooms`` counters since the last pass.  The first pass
  only takes the baseline (an OOM from before the governor started is no news); a resident
  first seen later counts all its OOMs (it registered, and ran out, since the last look).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from governor.model import GpuSignals, ResidentView, Snapshot
from gpulock import arbiter
from gpulock.arbiter import Settings

PSI_MEMORY = "/proc/pressure/memory"


def parse_psi(text: str | None) -> tuple[float | None, float | None]:
    """``(some avg10, full avg10)`` from a ``/proc/pressure/*`` file; None where absent or bad.

    The file reads::

        some avg10=0.31 avg60=0.12 avg300=0.04 total=123456
        full avg10=0.00 avg60=0.00 avg300=0.00 total=2345

    The ``full`` line is missing on some kernels (and for the ``cpu`` resource before 5.13).
    """
    found: dict[str, float | None] = {}
    for line in (text or "").splitlines():
        kind, _, rest = line.strip().partition(" ")
        if kind not in ("some", "full") or kind in found:
            continue
        value: float | None = None
        for field in rest.split():
            key, _, raw = field.partition("=")
            if key == "avg10":
                try:
                    number = float(raw)
                except ValueError:
                    break
                if 0.0 <= number <= 100.0:  # a share of time, in %: anything else is garbage
                    value = number
                break
        found[kind] = value
    return found.get("some"), found.get("full")


def read_psi_memory() -> str | None:
    """The text of ``/proc/pressure/memory``, or None (no PSI on this kernel, or ``psi=0``)."""
    try:
        with open(PSI_MEMORY, encoding="ascii", errors="replace") as f:
            return f.read(4096)
    except OSError:  # ENOENT without PSI; EOPNOTSUPP when it was turned off at boot
        return None


def read_swap_counters() -> tuple[int, int] | None:
    """Cumulative bytes swapped in and out since boot (psutil), or None when unknown."""
    import psutil  # only the governor needs it on this path: not imported by every cron job

    try:
        sw = psutil.swap_memory()
    except (OSError, RuntimeError):
        return None
    return int(sw.sin), int(sw.sout)


class Probe:
    """Collects one ``Snapshot`` per pass; remembers what rates and increases need."""

    def __init__(
        self,
        settings: Settings,
        *,
        psi_reader: Callable[[], str | None] = read_psi_memory,
        swap_reader: Callable[[], tuple[int, int] | None] = read_swap_counters,
        clock: Callable[[], float] = time.monotonic,
        clean: bool = True,
    ) -> None:
        """``clock`` is monotonic (swap rates); ``clean=False`` leaves dead records alone."""
        self.settings = settings
        self.psi_reader = psi_reader
        self.swap_reader = swap_reader
        self.clock = clock
        self.clean = clean
        self._swap_prev: tuple[float, int] | None = None  # (clock, sin + sout)
        self._ooms_prev: dict[str, int] | None = None  # resident id -> ooms, None: first pass

    def collect(self, now_wall: float) -> Snapshot:
        report, records = arbiter.residents(self.settings, clean=self.clean)
        gpus = tuple(GpuSignals(d.index, d.total_bytes, d.used_bytes) for d in report.devices)
        holders = arbiter.holder_pids(self.settings)
        min_idle = {t.name: t.min_idle_s for t in self.settings.config.tenants}
        views = tuple(
            ResidentView(
                id=r.id,
                name=r.name,
                gpu=r.gpu,
                pid=r.pid,
                policy=r.policy,
                bytes=r.bytes,
                in_use=r.in_use,
                last_used_wall=r.last_used_wall,
                owner_holds_lock=r.pid in holders,
                tenant=r.tenant,
                idle_known=r.idle_known,
                min_idle_s=min_idle.get(r.tenant) if r.tenant else None,
                torch_allocated_bytes=r.torch_allocated_bytes,
                torch_reserved_bytes=r.torch_reserved_bytes,
            )
            for r in records
        )
        some, full = parse_psi(self.psi_reader())
        tm = time.localtime(now_wall)
        return Snapshot(
            now_wall=now_wall,
            local_minutes=tm.tm_hour * 60 + tm.tm_min,
            gpus=gpus,
            residents=views,
            psi_some_avg10=some,
            psi_full_avg10=full,
            swap_bytes_per_s=self._swap_rate(),
            oom_reports=self._new_ooms({r.id: r.ooms for r in records}),
        )

    def _swap_rate(self) -> float | None:
        counters = self.swap_reader()
        now = self.clock()
        if counters is None:
            self._swap_prev = None
            return None
        total = counters[0] + counters[1]
        prev, self._swap_prev = self._swap_prev, (now, total)
        if prev is None:
            return None
        elapsed = now - prev[0]
        if elapsed <= 0 or total < prev[1]:  # same instant, or counters reset: no rate
            return None
        return (total - prev[1]) / elapsed

    def _new_ooms(self, current: dict[str, int]) -> int:
        prev, self._ooms_prev = self._ooms_prev, current
        if prev is None:
            return 0
        return sum(max(n - prev.get(rid, 0), 0) for rid, n in current.items())
