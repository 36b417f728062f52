"""What the cluster keeps in Redis: every key, in one place (``docs/cluster.md`` shows it too).

All keys start with ``cluster.prefix`` (default ``gpulock:``), so several clusters share one
Redis.  ``P`` below is the prefix.

``P hosts`` (sorted set)
    member: a host's name; score: the wall time of its last heartbeat.  The index of who has
    ever published; a member whose ``P host:NAME`` has expired is gone, and readers drop it.
``P host:NAME`` (string, JSON, expires after 3 heartbeats)
    the host's report, format ``gpulock.cluster.host/1`` (``gpulock.cluster.report``): its gateway,
    governor level, GPUs (total, free, holding, waiting, the wait estimate of each line), the
    route candidates it can run and which are warm, requests in flight.  A host that stops
    publishing (killed, frozen, partitioned) disappears when the key expires: nobody deletes it.
"""

from __future__ import annotations

from typing import Final

HOSTS: Final = "hosts"
HOST: Final = "host:"


def hosts(prefix: str) -> str:
    return prefix + HOSTS


def host(prefix: str, name: str) -> str:
    return prefix + HOST + name
