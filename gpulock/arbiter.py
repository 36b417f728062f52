"""The governor's one door into gpulock: what it reads and what it may change.

``governor/`` is built on gpulock but must not reach into its modules one by one (their
insides change; the governor's needs do not).  Everything it uses is here:

* reading: ``residents`` (every resident, library and tenant, one view), ``probe``
  (the device report, with tenant models counted on simulated GPUs), ``holder_pids``,
  ``queue_gpus``;
* acting: ``evict`` (library residents and tenant models alike, verified), ``ring_head``,
  ``publish_level``, ``Prewarmer`` (models confidently needed soon, warmed ahead); for a
  force-evict's kill, ``watch_owner`` / ``owner_claim`` / ``proven`` / ``end_owner`` /
  ``may_signal`` / ``signal_proven`` / ``clean_dead`` (a signal
  reaches only a process proven to hold the resident's claim: ``gpulock.core.proof``).
"""

from __future__ import annotations

from pathlib import Path

from gpulock.core import claim, devices, level
from gpulock.core.claim import end_owner
from gpulock.core.foresight import Forecast
from gpulock.core.identity import may_signal
from gpulock.core.level import Published
from gpulock.core.proof import proven
from gpulock.core.proof import send as signal_proven
from gpulock.core.settings import Settings
from gpulock.lock.census import holder_pids, queue_gpus
from gpulock.lock.queuedir import QueueDir
from gpulock.residents import registry
from gpulock.residents.eviction import evict
from gpulock.residents.outcome import EvictResult
from gpulock.residents.prewarm import Prewarmer
from gpulock.residents.registry import Record

__all__ = [
    "EvictResult",
    "Prewarmer",
    "Published",
    "Record",
    "Settings",
    "clean_dead",
    "end_owner",
    "evict",
    "holder_pids",
    "may_signal",
    "owner_claim",
    "probe",
    "proven",
    "publish_level",
    "queue_gpus",
    "residents",
    "ring_head",
    "signal_proven",
    "watch_owner",
]


def residents(
    settings: Settings, *, clean: bool = True
) -> tuple[devices.DeviceReport, list[Record]]:
    """The device report and every resident (library records, then tenant models), at once.

    Tenants are surveyed once; on a real GPU their models carry NVML's per-process figure.
    """
    lib = registry.Registry(settings, create=False).records(clean=clean)
    if not settings.config.tenants:
        return registry.probe_devices(settings, tenants=[]), lib
    from gpulock.tenants import survey

    listings = survey.survey(settings)
    trecs = registry.to_records(settings, listings)
    report = registry.probe_devices(settings, tenants=trecs)
    if report.source == "nvml":
        trecs = registry.to_records(settings, listings, report=report, track=False)
    return report, lib + trecs


def probe(settings: Settings) -> devices.DeviceReport:
    return registry.probe_devices(settings)


def ring_head(settings: Settings, gpu: int) -> int | None:
    """Ring the first waiter of one GPU's queue; its ticket number, or None."""
    return QueueDir(settings, gpu, create=False).ring_head()


def publish_level(settings: Settings, pub: Published) -> None:
    level.write(settings, pub)


def watch_owner(settings: Settings, r: Record) -> int | None:
    """A watch on a library resident's owner claim; None when the owner is gone."""
    reg = registry.Registry(settings, create=False)
    try:
        return claim.watch(reg.claim_path(r.owner))
    except claim.NotAClaim:
        return None


def owner_claim(settings: Settings, r: Record) -> Path:
    """The claim FIFO a library resident's owner holds open (what proves the owner)."""
    return registry.Registry(settings, create=False).claim_path(r.owner)


def clean_dead(settings: Settings) -> None:
    """Remove the records of owners that died (a ``cleanup`` event each)."""
    registry.Registry(settings, create=False).records()


def forecast(settings: Settings, records: list[Record], now_wall: float) -> Forecast | None:
    """Foresight's forecast for the governor's victims (``gpulock.core.foresight``), or None
    when ``eviction.policy`` is ``lru`` (then the governor keeps its own order)."""
    from gpulock.core import foresight
    from gpulock.residents.foresight_inputs import gather

    if foresight.policy_of(settings.config) != "foresight":
        return None
    gpus = sorted({r.gpu for r in records})
    return gather(settings, records, gpus, now_wall=now_wall)
