"""``rate_limit`` windows shared by the cluster: a request slot taken atomically before a call.

One sorted set per endpoint, ``P requests:CID``: a member per request (``HOST:RANDOM``), scored
by its wall time.  The script drops what is older than a minute, counts the rest and adds this
request only while the count is under the limit: N hosts calling at once never pass it.  The
key expires a minute after its last request.
"""

from __future__ import annotations

import os
import time
from typing import Final

from gpulock.cluster.store import Store

WINDOW_S: Final = 60.0

# KEYS[1]: the endpoint's set.  ARGV: now, window, limit, member.
TAKE: Final = """
local now, window, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local n = redis.call('ZCARD', KEYS[1])
if n >= limit then return {0, n} end
redis.call('ZADD', KEYS[1], now, ARGV[4])
redis.call('PEXPIRE', KEYS[1], math.floor(window * 1000) + 1000)
return {1, n}
"""


def key(prefix: str, cid: str) -> str:
    return f"{prefix}requests:{cid}"


def take(
    store: Store, cid: str, limit_per_min: int, *, now_wall: float | None = None
) -> tuple[bool, int]:
    """(taken?, requests in the last minute before this one), across the cluster."""
    now = time.time() if now_wall is None else now_wall
    member = f"{store.cc.host}:{os.urandom(6).hex()}"
    k = key(store.cc.prefix, cid)
    out = store.call(lambda r: r.eval(TAKE, 1, k, repr(now), repr(WINDOW_S), limit_per_min, member))
    return bool(int(out[0])), int(out[1])
