"""The registry of resident models, ``<state>/residents/``: records, and who may still count.

Every process that keeps a model in VRAM publishes a record there (``gpulock.residents.owner`` is
the owner's side); any process reads them.  A record counts only while its owner holds its
claim (``gpulock.core.claim``): a dead owner's records are recognisably dead, are cleaned by
whoever finds them, and never count as used memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpulock.core import claim, devices, identity, safejson
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.state import ensure_subdir
from gpulock.core.statefile import read_record

if TYPE_CHECKING:  # the tenants package is imported only when tenants are configured
    from gpulock.tenants import survey, usage
    from gpulock.tenants.base import TenantModel

FORMAT = "gpulock.resident/1"
POLICIES = ("persistent", "cold-start", "pinned")
FOLDER = "residents"
TENANT_ONLY = ("tenant", "tenant_state", "idle_known", "use_seen")


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
    # A tenant's model (gpulock.tenants): the tenant's name, its state there, and whether its
    # last use is known (no server reports it; unknown idle time never evicts).  Never read
    # from a record file: only the survey of configured tenants sets them.
    tenant: str | None = None
    tenant_state: str | None = None
    idle_known: bool = True
    # False for a tenant model never seen in use: its idle time is only "since first seen", a
    # lower bound (evidence for the governor), shown as "?" in status, never as a real idle
    use_seen: bool = True

    @property
    def bytes(self) -> int | None:
        """Best known size: measured, else declared; None when nobody knows."""
        return self.measured_bytes if self.measured_bytes is not None else self.declared_bytes


def encode(r: Record) -> bytes:
    return json.dumps({"format": FORMAT, **asdict(r)}, separators=(",", ":")).encode()


_NUMBER = (int, float)
_OPT_INT = (int, type(None))
# Every field's accepted types: a record is read by status, the governor and every waiter that
# makes room, so a field of the wrong type must be refused here, not crash one of them later.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "name": str,
    "gpu": int,
    "owner": str,
    "pid": int,
    "uid": int,
    "user": str,
    "program": str,
    "policy": str,
    "loaded_wall": _NUMBER,
    "last_used_wall": _NUMBER,
    "start_ticks": _OPT_INT,
    "pidns": (str, type(None)),
    "declared_bytes": _OPT_INT,
    "measured_bytes": _OPT_INT,
    "in_use": bool,
    "uses": int,
    "flush_every": _OPT_INT,
    "torch_allocated_bytes": _OPT_INT,
    "torch_reserved_bytes": _OPT_INT,
    "ooms": int,
}
_OWNER_RE = re.compile(r"[0-9]{1,10}-[0-9]{1,20}")  # "<pid>-<start ticks>": part of a path


def parse(data: bytes) -> Record:
    """A record from its file; ValueError for anything else (readers skip it)."""
    obj = safejson.loads(data)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError("not a resident record")
    known = {k: obj[k] for k in Record.__dataclass_fields__ if k in obj and k not in TENANT_ONLY}
    for key, typ in _FIELD_TYPES.items():
        if key in known and (
            not isinstance(known[key], typ) or (typ is not bool and isinstance(known[key], bool))
        ):
            raise ValueError(f"bad {key!r}")
    r = Record(**known)
    if r.policy not in POLICIES:
        raise ValueError(f"unknown policy {r.policy!r}")
    # The owner key names the claim's and socket's files: digits only (no '/', no '..'), and
    # the pid it names must be the record's own.
    if not _OWNER_RE.fullmatch(r.owner) or r.owner.split("-")[0] != str(r.pid):
        raise ValueError(f"bad owner {r.owner!r}")
    if not (0 < r.pid < 2**31 and 0 <= r.uid < 2**32 and r.gpu >= 0):
        raise ValueError("bad pid, uid or gpu")
    return r


# --- the folder ------------------------------------------------------------------------------


class Registry:
    """The files of ``<state>/residents``: the only code that reads or removes them."""

    def __init__(self, settings: Settings, *, create: bool = True) -> None:
        self.settings = settings
        self.path = settings.state_dir / FOLDER
        if create:
            ensure_subdir(settings.state_dir, FOLDER, group=settings.group)

    def claim_path(self, owner: str) -> Path:
        return self.path / f"owner-{owner}.fifo"

    def socket_path(self, owner: str) -> Path:
        return self.path / f"owner-{owner}.sock"

    def record_path(self, rid: str) -> Path:
        return self.path / f"{rid}.json"

    def records(self, *, clean: bool = True) -> list[Record]:
        """Live records (their owner holds its claim); dead ones are cleaned when ours to clean."""
        try:
            if not stat.S_ISDIR(os.lstat(self.path).st_mode):
                return []  # garbage in its place (a file, a symlink): no resident there
            names = sorted(os.listdir(self.path))
        except OSError:
            return []
        alive: dict[str, bool] = {}
        out = []
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                # Non-blocking and regular files only: a FIFO named x.json must not hang us.
                found = read_record(self.path / name, 1 << 16)
                if found is None:
                    continue
                r = parse(found[0])
            except (OSError, ValueError, TypeError, StateDirError):
                continue  # vanished or garbage: skipped, never a crash
            if name != f"{r.id}.json" or r.uid != found[1].st_uid:
                continue  # misnamed, or foreign: its writer is not the uid it names
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


def tenant_records(
    settings: Settings, *, report: devices.DeviceReport | None = None, track: bool = True
) -> list[Record]:
    """The models the configured tenants hold, as records (none without a ``tenants:`` list).

    Queries every tenant in parallel (``gpulock.tenants.survey``); one that does not answer
    contributes nothing here (``gpulock tenants`` says why).
    """
    if not settings.config.tenants:
        return []  # the tenants package is never imported without tenants configured
    from gpulock.tenants import survey

    return to_records(settings, survey.survey(settings), report=report, track=track)


def all_records(
    settings: Settings, *, clean: bool = True, tenants: list[Record] | None = None
) -> list[Record]:
    """The one view of every resident: library records, then tenant models.

    ``tenants``: the tenant records when the caller has them already (one survey per pass).
    """
    lib = Registry(settings, create=False).records(clean=clean)
    return lib + (tenant_records(settings) if tenants is None else tenants)


def used_bytes(
    settings: Settings,
    gpu: int,
    *,
    registry: Registry | None = None,
    tenants: list[Record] | None = None,
) -> int:
    """Simulated used memory of a GPU: what live residents and current holders declare.

    Per process the larger of the two counts (a holder usually loads the model it declared as
    its need), so a model is not counted twice.  Tenant models count with the server's own
    figure (``tenants``: as surveyed; a model of unknown size adds nothing it could prove).
    """
    from gpulock.lock.queuedir import QueueDir

    per_pid: dict[int, int] = {}
    recs = (registry or Registry(settings, create=False)).records(clean=False)
    for r in recs + (tenants or []):
        if r.tenant is not None and r.program == "command":
            continue  # its server holds a ticket with that need: counted with the holders
        if r.gpu == gpu and r.bytes:
            # A tenant's pid may be unknown (0, another user's server): key it by its id.
            key = r.pid if r.pid > 0 else -hash(r.id)
            per_pid[key] = per_pid.get(key, 0) + r.bytes
    for t in QueueDir(settings, gpu, create=False).holders():
        need = t.need_bytes if t.need_bytes is not None else 0
        per_pid[t.pid] = max(per_pid.get(t.pid, 0), need)
    return sum(per_pid.values())


def probe_devices(
    settings: Settings, *, tenants: list[Record] | None = None
) -> devices.DeviceReport:
    """The device report, with simulated GPUs' used memory taken from this registry.

    With tenants configured, their models count too: ``tenants`` when the caller surveyed
    them already, else they are surveyed here (only when a simulated GPU needs the figure).
    """
    cache: list[list[Record]] = [] if tenants is None else [tenants]

    def used(gpu: int) -> int:
        if not cache:
            cache.append(tenant_records(settings, track=False))
        return used_bytes(settings, gpu, tenants=cache[0])

    return devices.probe(settings.config, used_by=used)


# --- tenants' models as residents (the tenants package knows nothing of records) ------------


def to_records(
    settings: Settings,
    listings: list[survey.Listing],
    *,
    report: devices.DeviceReport | None = None,
    now_wall: float | None = None,
    track: bool = True,
) -> list[Record]:
    """Each listed model holding memory, as a resident record (``tenant`` set).

    ``report``: an NVML report gives each model the memory of its process (a llama-server
    router child, a LocalAI backend, a command server) or, for a one-process server, of the
    server's processes; a simulated GPU leaves ``measured_bytes`` None (the server's own
    figure is ``declared_bytes``).  ``track``: update the usage file (last use).
    """
    from gpulock.tenants import survey, usage

    now = time.time() if now_wall is None else now_wall
    specs = {s.name: s for s in settings.config.tenants}
    rows: list[tuple[survey.Listing, TenantModel]] = [
        (li, m) for li in listings for m in li.models if m.state != "sleeping"
    ]
    last: dict[str, float | None] = {}
    bounded: frozenset[str] = frozenset()
    if not track and rows:
        peeked = usage.peek(settings)
        last, bounded = peeked.last_used, peeked.bounded
    elif track:
        asked = frozenset(li.tenant for li in listings if li.reachable)
        seen = {f"{li.tenant}/{m.name}": m.fingerprint for li, m in rows}
        obs = usage.observe(settings, seen, now, asked=asked)
        last, bounded = obs.last_used, obs.bounded
        _residency_events(settings, rows, obs)
    nvml = report is not None and report.source == "nvml"
    if nvml:
        listings = [survey.with_pids(li) for li in listings]
        rows = [(li, m) for li in listings for m in li.models if m.state != "sleeping"]
    out = []
    for li, m in rows:
        spec = specs.get(li.tenant)
        rid = f"{li.tenant}/{m.name}"
        child = survey.child_pid(li, m) if nvml else None
        pid = m.pid or child or (li.pids[0] if li.pids else 0)
        measured = survey.measured_bytes(report, li, m, pid, child)
        used = last.get(rid)
        pinned = spec is not None and m.name in spec.pinned
        out.append(
            Record(
                id=rid,
                name=m.name,
                gpu=li.gpu,
                owner=f"tenant:{li.tenant}",
                pid=pid,
                uid=os.getuid(),
                user=li.tenant,
                program=li.actual_kind or li.kind,
                policy="pinned" if pinned else "persistent",
                loaded_wall=now,
                last_used_wall=used if used is not None else now,
                declared_bytes=m.size_bytes,
                measured_bytes=measured,
                in_use=bool(m.in_use),
                tenant=li.tenant,
                tenant_state=m.state,
                idle_known=used is not None,
                use_seen=used is not None and rid not in bounded,
            )
        )
    return out


def _residency_events(
    settings: Settings, rows: list[tuple[survey.Listing, TenantModel]], obs: usage.Observed
) -> None:
    """A ``resident`` event when a tenant model first shows, an ``unload`` when it is gone
    from an answering tenant's listing: the report draws tenant residencies like others."""
    by_id = {f"{li.tenant}/{m.name}": (li, m) for li, m in rows}
    for rid in obs.appeared:
        li, m = by_id[rid]
        where = {"path": m.path} if m.path else {}  # its file: what a pre-warm reads ahead
        settings.emit(
            "resident", resident=rid, name=m.name, gpu=li.gpu, tenant=li.tenant,
            declared_bytes=m.size_bytes, state=m.state, **where,
        )  # fmt: skip
    for rid in obs.vanished:
        tenant, _, name = rid.partition("/")
        spec = next((s for s in settings.config.tenants if s.name == tenant), None)
        settings.emit(
            "unload", resident=rid, name=name, gpu=spec.gpu if spec else None, tenant=tenant,
            reason="no longer in the tenant's listing",
        )  # fmt: skip


def tenant_entries(settings: Settings, *, now_wall: float | None = None) -> list[dict[str, Any]]:
    """``gpulock tenants --json``'s entries: each listing with pids, last use and idle time."""
    from gpulock.tenants import survey

    now = time.time() if now_wall is None else now_wall
    listings = [survey.with_pids(li) for li in survey.survey(settings)]
    last = {r.id: r for r in to_records(settings, listings, now_wall=now)}
    out = []
    for li in listings:
        e = survey.summary(li)
        for m in e["models"]:
            r = last.get(m["id"])
            known = r is not None and r.idle_known
            m["last_used_wall"] = r.last_used_wall if known and r is not None else None
            m["idle_s"] = round(now - r.last_used_wall, 3) if known and r is not None else None
        out.append(e)
    return out
