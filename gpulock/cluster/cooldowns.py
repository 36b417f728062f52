"""Cooldowns shared by the cluster: an endpoint that answered 429 (or failed) to one host is
skipped by every host until its cooldown ends.

One hash, ``P cooldowns``: field = the endpoint's cid, value = JSON ``{"until_wall", "reason",
"host"}``.  A later end wins over an earlier one; readers ignore ended ones, and each write
drops the fields that ended a day ago.  Losing the hash (Redis restarted) loses shared
cooldowns only: each host still keeps its own in its ledger.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, Final

from gpulock.cluster.store import Store
from gpulock.core import safejson

FIELD_MAX: Final = 4096

# KEYS[1]: the hash.  ARGV: cid, until_wall, the JSON value.  Keeps the later end.
WRITE: Final = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, old = pcall(cjson.decode, cur)
  if ok and type(old) == 'table' and tonumber(old['until_wall'] or 0) >= tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


def peer(host: str) -> str:
    """The cooldown of a peer (``gpulock serve`` refused, silent or dead), for every host."""
    return f"peer:{host}"


def cooling_peers(cids: Iterable[str]) -> frozenset[str]:
    """The peers among cooldown cids (``peer(host)`` read back): the hosts to skip."""
    return frozenset(c.removeprefix("peer:") for c in cids if c.startswith("peer:"))


def key(prefix: str) -> str:
    return prefix + "cooldowns"


def share(store: Store, cid: str, until_wall: float, reason: str, host: str) -> None:
    """Cool ``cid`` for every host until ``until_wall`` (``Unavailable`` when Redis is not)."""
    value = json.dumps({"until_wall": until_wall, "reason": reason[:200], "host": host})
    store.call(lambda r: r.eval(WRITE, 1, key(store.cc.prefix), cid, repr(until_wall), value))


def read(store: Store, *, now_wall: float | None = None) -> dict[str, tuple[float, str]]:
    """Cooldowns in force: cid -> (until_wall, "reason (on HOST)")."""
    now = time.time() if now_wall is None else now_wall
    raw: dict[str, str] = store.call(lambda r: r.hgetall(key(store.cc.prefix)))
    out: dict[str, tuple[float, str]] = {}
    ended: list[str] = []
    for cid, value in raw.items():
        c = _parse(value)
        if c is None or c[0] <= now - 86400:
            ended.append(cid)
        elif c[0] > now:
            out[cid] = c
    if ended:
        store.call(lambda r: r.hdel(key(store.cc.prefix), *ended))
    return out


def _parse(value: str) -> tuple[float, str] | None:
    if len(value) > FIELD_MAX:
        return None
    try:
        obj: Any = safejson.loads(value)
        until = float(obj["until_wall"])
        why = f"{obj.get('reason', '')} (on {obj.get('host', '?')})"
    except (ValueError, TypeError, KeyError):
        return None
    return until, why
