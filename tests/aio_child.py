"""A child that waits in line through ``gpulock.acquire_async`` on an asyncio event loop.

``python tests/aio_child.py '<json options>'``: the options and the audit records are those of
``procs.py``'s child (``grant`` after the lease is had, ``release`` before it is released), and
like it the child is driven through stdin, one line per step, read on the event loop itself.
While it waits, a ticker task writes ``tick`` records: proof that the loop is not blocked.
``run_job`` (``--job``) is the command a ``gpulock run`` job runs in the same tests: it writes
the same records, its ticket taken from ``GPULOCK_TICKET``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procs import _Audit


async def _line() -> bytes:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()
    buf = bytearray()

    def readable() -> None:
        ch = os.read(0, 1)
        if ch:
            buf.extend(ch)
        if (not ch or ch == b"\n") and not got.done():
            got.set_result(bytes(buf))

    loop.add_reader(0, readable)
    try:
        return await got
    finally:
        loop.remove_reader(0)


async def main(opts: dict[str, Any]) -> int:
    import gpulock

    audit = _Audit(opts["audit"], opts["name"])

    async def ticker() -> None:
        while True:
            audit.write("tick")
            await asyncio.sleep(0.2)

    tick = asyncio.create_task(ticker())
    try:
        async with gpulock.acquire_async(
            gpu=opts.get("gpu", 0),
            need=opts.get("need"),
            timeout=opts.get("timeout"),
            name=opts["name"],
            config=opts.get("config"),
        ) as lease:
            tick.cancel()
            audit.write("grant", lease.ticket, pid=os.getpid(), need_bytes=lease.need_bytes)
            await _line()
            audit.write("release", lease.ticket)
    except gpulock.LockTimeout as e:
        audit.write("timeout", gpu=e.gpu, waited_s=e.waited_s)
        return 3
    return 0


def run_job(audit_path: str, name: str) -> int:
    """The command of a ``gpulock run`` job: grant record, wait for a line, release record."""
    audit = _Audit(audit_path, name)
    seq = int(os.environ["GPULOCK_TICKET"].split(":")[1])
    audit.write("grant", seq, pid=os.getpid(), need_bytes=None)
    sys.stdin.readline()
    audit.write("release", seq)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--job":
        sys.exit(run_job(sys.argv[2], sys.argv[3]))
    sys.exit(asyncio.run(main(json.loads(sys.argv[1]))))
