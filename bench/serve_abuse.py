"""``gpulock serve`` under a slow-client flood: how much later a normal request is answered.

Run: ``.venv/bin/python bench/serve_abuse.py [--slow N] [--requests N] [--read-timeout S]``
(~30 s)

The gateway and its upstream are those of ``bench/serve.py`` (a stand-in OpenAI server that
answers at once, as the cloud-tier route ``fast``).  First ``--requests`` (200) normal requests
one after another, alone; then more for as long as ``--slow`` (500) connections, opened by a second
process, send their headers (half of them) or their body (the other half) a byte a second.  The
gateway's ``serve.read_timeout`` is ``--read-timeout`` (6 s) so that the run also shows the
flood being closed: the slow connections that got their 408 or were closed before the end.
Also the gateway's resident memory before and after.  Target: the slowest normal request during
the flood no more than 100 ms later than the slowest alone.  Side by side, the same flood on the
upstream itself (Starlette on uvicorn, as it comes): what a client meets without the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_serve", HERE / "serve.py")
assert _spec is not None and _spec.loader is not None
bs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)

BODY = json.dumps(bs.BODY).encode()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))


def normal(port: int, n: int) -> list[float]:
    """``n`` requests one after another on fresh connections: seconds each."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        c.close()
        assert r.status == 200, r.status
        out.append(time.perf_counter() - start)
    return out


async def flood(port: int, n: int, seconds: float) -> dict[str, int]:
    """``n`` connections sending a byte a second for ``seconds``: how they ended."""
    ends = {"answered": 0, "closed": 0, "still open": 0}
    line = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"

    async def one(i: int) -> None:
        slow_head = i % 2 == 1
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(line if slow_head else line + b"Content-Length: 4000\r\n\r\n")
        drip = b"X-Slow: yes\r\n" * 100 if slow_head else b"{" + b" " * 3999
        stop = time.monotonic() + seconds
        end = "still open"
        for k in range(len(drip)):
            if time.monotonic() > stop:
                break
            try:
                writer.write(drip[k : k + 1])
                await writer.drain()
                got = await asyncio.wait_for(reader.read(1), 1.0)
            except TimeoutError:
                continue  # nothing yet: the next byte
            except OSError:
                end = "closed"
                break
            end = "answered" if got else "closed"
            break
        ends[end] += 1
        writer.close()

    await asyncio.gather(*(one(i) for i in range(n)))
    return ends


@dataclass
class Run:
    alone: list[float]  # seconds per normal request, before the flood
    during: list[float]  # and while it lasts
    ends: dict[str, int]  # how the slow connections ended
    rss: tuple[int, int, int]  # the server's resident KiB before, during and after

    @property
    def added_ms(self) -> float:
        return (max(self.during) - max(self.alone)) * 1e3


def under_flood(port: int, pid: int, slow: int, requests: int, seconds: float) -> Run:
    """Normal requests to the server on ``port`` (process ``pid``) alone, then for as long as
    ``slow`` connections from a second process drip bytes for ``seconds``."""
    normal(port, 50)  # warm
    rss0 = rss_kib(pid)
    alone = normal(port, requests)
    flooder = subprocess.Popen(
        [sys.executable, __file__, "--slow", str(slow), "--flood", str(port), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)  # the connections open
    rss_flood = rss_kib(pid)
    during: list[float] = []
    while flooder.poll() is None:  # normal requests for as long as the flood lasts
        during += normal(port, 10)
    out, _ = flooder.communicate(timeout=60)
    ends: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    time.sleep(1)
    return Run(alone, during, ends, (rss0, rss_flood, rss_kib(pid)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", type=int, default=500)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--read-timeout", type=float, default=6.0)
    ap.add_argument("--flood", nargs=2, metavar=("PORT", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.flood:
        ends = asyncio.run(flood(int(args.flood[0]), args.slow, float(args.flood[1])))
        print(json.dumps(ends), flush=True)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="gpulock-bench-abuse-"))
    up_port, gw_port = bs.free_port(), bs.free_port()
    up_url = f"http://127.0.0.1:{up_port}/v1"
    config = tmp / "gpulock.yaml"
    config.write_text(
        f"serve: {{read_timeout: {args.read_timeout}s}}\nroutes:\n  fast:\n"
        f"    - {{tier: cloud, backend: openai, model: m, base_url: {up_url}, "
        f"api_key_env: {bs.KEY_ENV}}}\n"
    )
    env = {
        **os.environ,
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(tmp / "state"),
        bs.KEY_ENV: "bench",
        "PYTHONPATH": str(bs.REPO),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", bs.UPSTREAM, str(up_port), "0"],
            env=env,
            start_new_session=True,
            stderr=subprocess.DEVNULL,  # its tracebacks for the slow clients that hang up
        ),
        subprocess.Popen(
            [sys.executable, "-m", "gpulock", "serve", "--listen", f"127.0.0.1:{gw_port}"],
            env=env,
            start_new_session=True,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        bs.wait_up(f"{up_url}/models", procs[0])
        bs.wait_up(f"http://127.0.0.1:{gw_port}/health", procs[1])
        gw = under_flood(gw_port, procs[1].pid, args.slow, args.requests, args.read_timeout + 3)
        up = under_flood(up_port, procs[0].pid, args.slow, args.requests, args.read_timeout + 3)
    finally:
        bs.kill_all(procs)

    def row(name: str, v: list[float]) -> str:
        p50, p99, mx = bs.pct(v, 0.5) * 1e3, bs.pct(v, 0.99) * 1e3, max(v) * 1e3
        return f"| {name} | {p50:.2f} ms | {p99:.2f} ms | {mx:.2f} ms |"

    load1 = os.getloadavg()[0]
    print(
        f"\nnormal requests alone and during {args.slow} slow connections, through gpulock serve "
        f"(serve.read_timeout {args.read_timeout:g} s) and to its upstream directly (Starlette "
        f"on uvicorn, as it comes) ({os.cpu_count()} CPUs, load average {load1:.1f})\n"
    )
    print("| normal requests | p50 | p99 | slowest |")
    print("| --- | --- | --- | --- |")
    for name, r in (("gpulock serve", gw), ("uvicorn direct", up)):
        print(row(f"{name}, alone", r.alone))
        print(row(f"{name}, during {args.slow} slow clients", r.during))
    print()
    for name, r in (("gpulock serve", gw), ("uvicorn direct", up)):
        print(
            f"{name}: slow connections {r.ends['answered']} answered and closed, "
            f"{r.ends['closed']} closed, {r.ends['still open']} still open at the end; RSS "
            f"{r.rss[0] / 1024:.1f} MiB before, {r.rss[1] / 1024:.1f} MiB during, "
            f"{r.rss[2] / 1024:.1f} MiB after"
        )
    targets = (
        ("the slowest normal request at most 100 ms later than alone", gw.added_ms <= 100),
        ("no slow connection still open at the end", gw.ends["still open"] == 0),
    )
    missed = [name for name, met in targets if not met]
    print(
        f"\nsummary: the slowest normal request during {args.slow} slow clients took "
        f"{max(gw.during) * 1e3:.1f} ms ({gw.added_ms:+.1f} ms against alone) through gpulock "
        f"serve, {max(up.during) * 1e3:.1f} ms ({up.added_ms:+.1f} ms) on uvicorn directly; "
        f"slow connections still open at the end {gw.ends['still open']} of {args.slow} vs "
        f"{up.ends['still open']}; gateway RSS {gw.rss[0] / 1024:.1f} -> "
        f"{gw.rss[2] / 1024:.1f} MiB; " + ("PASS" if not missed else "FAILED: " + "; ".join(missed))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
