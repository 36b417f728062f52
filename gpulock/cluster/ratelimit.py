"""``rate_limit`` windows shared by the cluster: request slots taken atomically before calls.

One hash per endpoint, ``P rate:CID``: the requests started in each whole second of the last
minute (field: the second, value: how many), as each host's ledger keeps them
(``gpulock.router.ledger``: a second counts while ``now - second < 61``, so the window errs a
second long, never short).  The script drops the seconds that left, counts the rest and adds
this host's slots only while the count is under the limit: N hosts calling at once never pass
it.  A host that makes many calls (``gpulock serve``) takes a block of slots for the current
second at once (``gpulock.router.allowance``: never more than a share of those left) and gives
back what that second did not use.  The key expires a minute after its last take.

(Before, one sorted set per endpoint kept a member per request, ``P requests:CID``; the new key
has a new name, so a host still running the older code never meets the other's type.)
"""

from __future__ import annotations

import time
from typing import Final

from gpulock.cluster.store import Store

WINDOW_S: Final = 60.0
SPAN_S: Final = WINDOW_S + 1  # a whole second counts while now - second < SPAN_S

# KEYS[1]: the endpoint's counts.  ARGV: now, span, limit, wanted, share.
# Returns {taken?, requests in the window before, slots taken}.
TAKE: Final = """
local now, span, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local wanted, share = tonumber(ARGV[4]), tonumber(ARGV[5])
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  local s = tonumber(all[i])
  if s == nil or now - s >= span or s - now >= span then
    redis.call('HDEL', KEYS[1], all[i])
  else
    n = n + (tonumber(all[i + 1]) or 0)
  end
end
if n >= limit then return {0, n, 0} end
local take = math.max(1, math.min(wanted, math.floor((limit - n) * share)))
redis.call('HINCRBY', KEYS[1], string.format('%d', math.floor(now)), take)
redis.call('PEXPIRE', KEYS[1], math.floor(span * 1000) + 1000)
return {1, n, take}
"""

# KEYS[1]: the endpoint's counts.  ARGV: second, slots not used.
GIVE_BACK: Final = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local left = cur - tonumber(ARGV[2])
if left > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', left))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return left
"""


def key(prefix: str, cid: str) -> str:
    return f"{prefix}rate:{cid}"


def take(
    store: Store, cid: str, limit_per_min: int, *, now_wall: float | None = None
) -> tuple[bool, int]:
    """(taken?, requests in the last minute before this one), across the cluster."""
    ok, used, _n = take_block(store, cid, limit_per_min, 1, share=0.0, now_wall=now_wall)
    return ok, used


def take_block(
    store: Store,
    cid: str,
    limit_per_min: int,
    wanted: int,
    *,
    share: float,
    now_wall: float | None = None,
) -> tuple[bool, int, int]:
    """(taken?, requests in the last minute before these, slots taken): ``wanted`` slots for
    this second, never more than ``share`` of those left (at least one), across the cluster."""
    now = time.time() if now_wall is None else now_wall
    k = key(store.cc.prefix, cid)
    argv = (repr(now), repr(SPAN_S), limit_per_min, max(1, wanted), repr(share))
    out = store.call(lambda r: r.eval(TAKE, 1, k, *argv))
    return bool(int(out[0])), int(out[1]), int(out[2])


def give_back(store: Store, cid: str, second: int, n: int) -> None:
    """Uncount ``n`` slots taken in ``second`` and never used."""
    if n <= 0:
        return
    k = key(store.cc.prefix, cid)
    store.call(lambda r: r.eval(GIVE_BACK, 1, k, str(int(second)), int(n)))
