"""What the governor measures each pass: GPUs, residents, host memory pressure, swap, OOMs.

``Probe.collect(now_wall)`` returns one ``Snapshot`` (``gpulock.governor.model``) for the pure
policy. Every reader of the world is injected through the constructor, real ones by default, so a
test
can script PSI text or swap counters without patching modules:

* GPUs and residents: ``gpulock.arbiter.residents`` (NVML, or simulated GPUs whose used
  memory is what live residents, tenant models and holders declare; library residents and the
  tenants' models in one list); a resident's owner "holds the lock"
  when its pid is the pid or the command pid (``gpulock run``) of a live holding ticket.
* Host memory pressure: ``/proc/pressure/memory`` (PSI, Linux 4.20+), ``some`` and ``full``
  avg10.  A kernel without PSI, or one booted with ``psi=0``, gives None, never 0.
* Swap: ``/proc/vmstat``'s cumulative ``pswpin`` and ``pswpout`` pages, times the page size
  (``os.sysconf``: 4 KiB on x86, 16 or 64 KiB on some ARM kernels); the rate needs two samples,
  so the first pass says None.
* Kernel OOM kills: the increase of ``/proc/vmstat``'s ``oom_kill`` (Linux 4.13+) since the last
  pass; None on the first pass and where the kernel does not count them.
* OOMs: the increase of the residents' ``ooms`` counters since the last pass.  The first pass
  only takes the baseline (an OOM from before the governor started is no news); a resident
  first seen later counts all its OOMs (it registered, and ran out, since the last look).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpulock import arbiter
from gpulock.arbiter import Settings
from gpulock.governor.model import GpuSignals, ResidentView, Snapshot

PSI_MEMORY = "/proc/pressure/memory"
VMSTAT = "/proc/vmstat"


@dataclass(frozen=True, slots=True)
class VmStat:
    """The ``/proc/vmstat`` counters the governor reads; None where absent or garbage."""

    swap_in_bytes: int | None
    swap_out_bytes: int | None
    oom_kills: int | None


def parse_vmstat(text: str | None, page_bytes: int) -> VmStat:
    """Swap traffic (pages times ``page_bytes``) and kernel OOM kills since boot.

    The file is one ``name value`` pair per line (``pswpin 1234``); unknown names are ignored.
    """
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _, raw = line.strip().partition(" ")
        if name in ("pswpin", "pswpout", "oom_kill") and raw.strip().isdigit():
            values[name] = int(raw)
    pin, pout = values.get("pswpin"), values.get("pswpout")
    return VmStat(
        None if pin is None else pin * page_bytes,
        None if pout is None else pout * page_bytes,
        values.get("oom_kill"),
    )


def read_vmstat() -> str | None:
    """The text of ``/proc/vmstat``, or None where there is none (not Linux, no /proc)."""
    try:
        with open(VMSTAT, encoding="ascii", errors="replace") as f:
            return f.read(1 << 16)
    except OSError:
        return None


def page_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 4096  # what every Linux the kernel's docs name uses when it cannot be asked


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
    """Cumulative bytes swapped in and out since boot (``/proc/vmstat``), or None."""
    return _swap_of(parse_vmstat(read_vmstat(), page_bytes()))


class Probe:
    """Collects one ``Snapshot`` per pass; remembers what rates and increases need."""

    def __init__(
        self,
        settings: Settings,
        *,
        psi_reader: Callable[[], str | None] = read_psi_memory,
        swap_reader: Callable[[], tuple[int, int] | None] | None = None,
        vmstat_reader: Callable[[], str | None] = read_vmstat,
        clock: Callable[[], float] = time.monotonic,
        clean: bool = True,
    ) -> None:
        """``clock`` is monotonic (swap rates); ``clean=False`` leaves dead records alone.

        ``vmstat_reader`` gives ``/proc/vmstat``'s text (swap and OOM kills), read once a pass;
        ``swap_reader``, when given, overrides the swap counters taken from it.
        """
        self.settings = settings
        self.psi_reader = psi_reader
        self.swap_reader = swap_reader
        self.vmstat_reader = vmstat_reader
        self.page_bytes = page_bytes()
        self._kills_prev: int | None = None  # oom_kill at the last pass
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
        vm = parse_vmstat(self.vmstat_reader(), self.page_bytes)
        swap = self.swap_reader() if self.swap_reader is not None else _swap_of(vm)
        tm = time.localtime(now_wall)
        return Snapshot(
            now_wall=now_wall,
            local_minutes=tm.tm_hour * 60 + tm.tm_min,
            gpus=gpus,
            residents=views,
            psi_some_avg10=some,
            psi_full_avg10=full,
            swap_bytes_per_s=self._swap_rate(swap),
            oom_reports=self._new_ooms({r.id: r.ooms for r in records}),
            oom_kills=self._new_kills(vm.oom_kills),
            forecast=arbiter.forecast(self.settings, records, now_wall) if records else None,
        )

    def _new_kills(self, count: int | None) -> int | None:
        """Kernel OOM kills since the last pass; None on the first (a baseline) or unknown."""
        prev, self._kills_prev = self._kills_prev, count
        if prev is None or count is None or count < prev:
            return None
        return count - prev

    def _swap_rate(self, counters: tuple[int, int] | None) -> float | None:
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


def _swap_of(vm: VmStat) -> tuple[int, int] | None:
    if vm.swap_in_bytes is None or vm.swap_out_bytes is None:
        return None
    return vm.swap_in_bytes, vm.swap_out_bytes
