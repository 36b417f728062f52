"""Gathering foresight's inputs on this machine: the event log's past, the line, the crontab.

The decision is ``gpulock.core.foresight`` (pure); this module does the reading around it:

* **history** and **who uses what** -- the event log's past (``foresight_past``): uses, reload
  costs, each agent's models, plus each resident's own last use;
* **the line** -- tickets waiting on the GPU: their agents' models are needed now;
* **cron** -- the crontab's and the running fleets' next fires (``foresight_cron``), mapped to
  their models.

The fleet's own schedules (APScheduler, in ``agents``) are above gpulock, which never imports
them; a fleet's runs reach foresight as history (its agents' ``call`` events keep a rhythm).
Every source is optional: a part that cannot be read adds nothing, never an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from gpulock.core import foresight as fs
from gpulock.core.settings import Settings
from gpulock.residents.foresight_cron import cron_plans, fleet_plans
from gpulock.residents.foresight_past import Past, read_past
from gpulock.residents.registry import Record


def model_key(r: Record) -> str:
    """The name foresight knows a resident by: its model name (what the events call it)."""
    return r.name


def gather(
    settings: Settings,
    records: Sequence[Record],
    gpus: Iterable[int],
    *,
    now_wall: float | None = None,
) -> fs.Forecast:
    """The forecast for ``records`` (residents and tenant models) at ``now_wall``; the
    tickets waiting on ``gpus`` count as uses now."""
    now = time.time() if now_wall is None else now_wall
    past = read_past(settings.state_dir, mode=settings.file_mode)
    uses = past.uses + [fs.Use(model_key(r), r.last_used_wall) for r in records if r.idle_known]
    models = {model_key(r): r.bytes for r in records}
    return fs.forecast(
        models, plans(settings, past, gpus, now), uses, past.loads, now,
        utc_offset_s=float(local_offset_s(now)),
    )  # fmt: skip


def plans(settings: Settings, past: Past, gpus: Iterable[int], now_wall: float) -> list[fs.Planned]:
    """The declared future uses: the tickets waiting on ``gpus``, then the crontab's and the
    running fleets' next fires, each as the models its agent called (``past.models_of``)."""
    out = [p for gpu in gpus for p in waiters(settings, gpu, past.models_of, now_wall)]
    out += cron_plans(past.models_of, now_wall)
    out += fleet_plans(past.fleets, past.models_of, now_wall)
    return out


def local_offset_s(now_wall: float) -> int:
    return time.localtime(now_wall).tm_gmtoff


def waiters(
    settings: Settings, gpu: int, models_of: dict[str, set[str]], now_wall: float
) -> list[fs.Planned]:
    """The models of the tickets waiting on ``gpu``: needed soon, in line order."""
    from gpulock.lock.queuedir import QueueDir

    try:
        qdir = QueueDir(settings, gpu, create=False)
        found = [tf.ticket for _seq, tf, _why in qdir.scan() if tf is not None]
    except OSError:
        return []
    line = sorted((t for t in found if not t.holding), key=lambda t: t.seq)
    return fs.line_plans(
        [(t.name, sorted(models_of.get(t.name, ()))) for t in line if t.name in models_of],
        now_wall,
    )
