"""Cloud spend shared by the cluster: check-and-reserve before a call, settle after, atomically.

One hash a UTC day, ``P spend:YYYY-MM-DD``: field ``HOST<TAB>CID`` -> that host's spend on
that endpoint today, reservations of calls under way included.  A Lua script checks a
reservation against the model's ``daily_budget`` and ``router.daily_budget`` summed over every
host, and adds it, in one step: N hosts calling at once never spend past a budget (checking
before and spending after, as LiteLLM does, overshoots).  Settling adds what the call really
cost minus what was reserved.

Each host's own ledger file is the truth for its own spend: every reservation first raises the
host's fields to what its ledger says, so a Redis that came back empty (restarted without
persistence, failed over with writes lost) is refilled by the hosts' next calls and no budget
starts again from zero.  The day is the UTC day, so hosts in other time zones or with skewed
clocks count the same day.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final

from gpulock.cluster.store import Store
from gpulock.core.units import calendar_day

SEP: Final = "\t"  # never in a host name (printable) nor in a cid
KEEP_S: Final = 3 * 86400  # a day's hash outlives the day (late settlements, reading it)

# KEYS[1]: the day's hash.  ARGV: host, cid, amount, model budget ("" none), total budget
# ("" none), keep seconds, hosts expected, ahead, share, unit, then pairs cid, this host's
# ledger spend (the refill).  Each host also keeps a field HOST<TAB> (0): who has reported today.
# Until every expected host has (a Redis that came back empty, a new day), a host spends only
# its own share.  ``ahead``: reserved beyond ``amount`` when it fits, never more than ``share``
# of what would be left after ``amount``, in whole ``unit``s (a block of whole calls:
# gpulock.router.allowance).
RESERVE: Final = """
local host, cid, amount = ARGV[1], ARGV[2], tonumber(ARGV[3])
local expected = tonumber(ARGV[7])
redis.call('HSETNX', KEYS[1], host .. '\\t', '0')
for i = 11, #ARGV, 2 do
  local field = host .. '\\t' .. ARGV[i]
  local mine = tonumber(ARGV[i + 1])
  local cur = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if mine > cur then redis.call('HSET', KEYS[1], field, tostring(mine)) end
end
local all = redis.call('HGETALL', KEYS[1])
local model, total, own_model, own_total, hosts = 0, 0, 0, 0, {}
local n = 0
for i = 1, #all, 2 do
  local v = tonumber(all[i + 1]) or 0
  local tab = string.find(all[i], '\\t', 1, true)
  if tab then
    local h, c = string.sub(all[i], 1, tab - 1), string.sub(all[i], tab + 1)
    if not hosts[h] then hosts[h] = true; n = n + 1 end
    total = total + v
    if c == cid then model = model + v end
    if h == host then
      own_total = own_total + v
      if c == cid then own_model = own_model + v end
    end
  end
end
local share = 1
if n < expected then
  share, model, total = expected, own_model, own_total
end
local ok, left = 1, nil
if ARGV[4] ~= '' then
  local budget = tonumber(ARGV[4]) / share
  if model + amount > budget + 1e-9 then ok = 0 end
  left = budget - model
end
if ARGV[5] ~= '' then
  local budget = tonumber(ARGV[5]) / share
  if total + amount > budget + 1e-9 then ok = 0 end
  if left == nil or budget - total < left then left = budget - total end
end
local grant = 0
if ok == 1 then
  local ahead, unit = tonumber(ARGV[8]), tonumber(ARGV[10])
  if left ~= nil then ahead = math.min(ahead, math.max(0, (left - amount) * tonumber(ARGV[9]))) end
  if unit > 0 then ahead = math.floor(ahead / unit + 1e-9) * unit else ahead = 0 end
  grant = amount + ahead
  if grant > 0 then
    redis.call('HINCRBYFLOAT', KEYS[1], host .. '\\t' .. cid, tostring(grant))
  end
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
local room = ''
if left ~= nil then room = tostring(left) end
return {ok, tostring(model), tostring(total), tostring(grant), room}
"""


def day(now_wall: float) -> str:
    """The UTC day the spend of ``now_wall`` counts in (``2026-11-26``)."""
    return calendar_day(now_wall, utc=True)


def day_key(prefix: str, now_wall: float) -> str:
    return f"{prefix}spend:{day(now_wall)}"


def reserve(
    store: Store,
    cid: str,
    amount_usd: float,
    *,
    model_budget_usd: float | None,
    total_budget_usd: float | None,
    local_spend_usd: Mapping[str, float],
    hosts_expected: int = 1,
    now_wall: float | None = None,
) -> tuple[bool, float, float]:
    """(reserved?, the model's spend today, the cluster's spend today), before this one.

    ``hosts_expected``: the hosts last seen; until that many have reported today, this host's
    own spend is held to its share.  ``Unavailable`` when Redis cannot be used: the caller
    falls back to its share."""
    ok, model, total, _granted, _left = reserve_block(
        store,
        cid,
        amount_usd,
        ahead_usd=0.0,
        share=0.0,
        model_budget_usd=model_budget_usd,
        total_budget_usd=total_budget_usd,
        local_spend_usd=local_spend_usd,
        hosts_expected=hosts_expected,
        now_wall=now_wall,
    )
    return ok, model, total


def reserve_block(
    store: Store,
    cid: str,
    amount_usd: float,
    *,
    ahead_usd: float,
    share: float,
    unit_usd: float = 0.0,
    model_budget_usd: float | None,
    total_budget_usd: float | None,
    local_spend_usd: Mapping[str, float],
    hosts_expected: int = 1,
    now_wall: float | None = None,
) -> tuple[bool, float, float, float, float | None]:
    """``reserve``, and up to ``ahead_usd`` more when it fits, never more than ``share`` of what
    would be left after ``amount_usd``, in whole ``unit_usd`` (0: nothing ahead): (reserved?,
    the model's spend, the cluster's spend (before this), what was reserved in all, what was
    left of the tightest budget before it (None: no budget))."""
    now = time.time() if now_wall is None else now_wall
    key = day_key(store.cc.prefix, now)
    argv: list[Any] = [store.cc.host, cid, repr(float(amount_usd))]
    argv += [_opt(model_budget_usd), _opt(total_budget_usd), KEEP_S, max(1, hosts_expected)]
    argv += [repr(float(max(0.0, ahead_usd))), repr(float(share)), repr(float(unit_usd))]
    for k, v in sorted(local_spend_usd.items()):
        argv += [k, repr(float(v))]
    out = store.call(lambda r: r.eval(RESERVE, 1, key, *argv))
    left = float(out[4]) if len(out) > 4 and out[4] not in ("", b"") else None
    return bool(int(out[0])), float(out[1]), float(out[2]), float(out[3]), left


def refill(store: Store, local_spend_usd: Mapping[str, float]) -> None:
    """Say this host is here today and raise its fields to its ledger (a heartbeat's part)."""
    reserve(
        store, "", 0.0, model_budget_usd=None, total_budget_usd=None,
        local_spend_usd=local_spend_usd,
    )  # fmt: skip


def settle(store: Store, cid: str, delta_usd: float, *, now_wall: float | None = None) -> None:
    """Add ``delta_usd`` (what the call cost minus what was reserved; may be negative)."""
    if not delta_usd:
        return
    now = time.time() if now_wall is None else now_wall
    key = day_key(store.cc.prefix, now)
    field = store.cc.host + SEP + cid
    store.call(lambda r: r.hincrbyfloat(key, field, repr(float(delta_usd))))


def spent(store: Store, *, now_wall: float | None = None) -> dict[str, float]:
    """Today's spend by cid, summed over the hosts (for ``gpulock cluster``)."""
    now = time.time() if now_wall is None else now_wall
    raw: dict[str, str] = store.call(lambda r: r.hgetall(day_key(store.cc.prefix, now)))
    out: dict[str, float] = {}
    for field, value in raw.items():
        _host, _, cid = field.partition(SEP)
        if not cid:
            continue  # the host's presence mark
        try:
            out[cid] = out.get(cid, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _opt(v: float | None) -> str:
    return "" if v is None else repr(float(v))
