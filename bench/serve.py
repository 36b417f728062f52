"""``gpulock serve`` in front of an upstream, side by side with calling the upstream directly.

Run: ``.venv/bin/python bench/serve.py [--requests N] [--seconds S] [--upstream-ms MS]
[--json FILE]``  (~1 min)

The upstream is a minimal OpenAI-compatible server (Starlette on uvicorn, in its own process):
``/v1/chat/completions`` answers a fixed completion at once, or streams 16 chunks, so that what
is measured is the gateway, not a model.  ``--upstream-ms MS`` makes it wait MS milliseconds
(off this machine's CPU, as a model computing on a GPU does) before it answers: with 0 the
gateway's own cost is all there is to see; with a model's time, what that cost means to a user.
The gateway is a real ``gpulock serve`` (its own process) whose route ``fast`` is that server as
an OpenAI-compatible (cloud-tier) candidate: each request is parsed, routed (the router's probe
and choice), forwarded over a kept-alive connection, and its answer re-rendered.  The clients
are ``aiohttp`` sessions in this process.

(a) Added latency, non-streaming: ``--requests`` (400) sequential chat requests, direct and
    through the gateway alternately; p50 / p99 of each, and the difference.
(b) Time to first token, streaming: the same, to the first content chunk.
(c) Throughput at 1, 8 and 64 concurrent clients for ``--seconds`` (4) each, in four alternating
    slices (direct, gateway, direct, ...): requests per second of each, and the ratio.
(d) The gateway's memory: peak resident set (VmHWM) after the run.

Everything shares this machine's cores (clients, gateway and upstream): on 2 cores the
throughput ratio at 64 clients measures CPU more than waiting.  Targets: <= 2 ms added p50,
<= 5 ms TTFT overhead, >= 90 % of direct throughput at 64 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KEY_ENV = "GPULOCK_BENCH_KEY"
BODY = {"model": "fast", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}

UPSTREAM = """
import asyncio, json, sys, time
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
import uvicorn

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                       "logprobs": None, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

def chunk(piece, finish=None):
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": piece} if piece else {},
                      "finish_reason": finish}]}
    return b"data: " + json.dumps(c).encode() + b"\\n\\n"

DELAY_S = int(sys.argv[2]) / 1000

async def chat(request):
    body = await request.json()
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    if not body.get("stream"):
        return JSONResponse(ANSWER)
    async def gen():
        for i in range(16):
            yield chunk(f"w{i} ")
        yield chunk(None, "stop")
        yield b"data: [DONE]\\n\\n"
    return StreamingResponse(gen(), media_type="text/event-stream")

async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/v1/models", models)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited ({proc.returncode}) before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 (127.0.0.1 only)
                if r.status < 500:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} did not answer within 60 s")


async def one(client: Any, url: str, stream: bool) -> float:
    """Seconds to the whole answer, or (streaming) to the first content chunk."""
    start = time.perf_counter()
    if not stream:
        async with client.post(url, json=BODY) as r:
            r.raise_for_status()
            json.loads(await r.read())
        return time.perf_counter() - start
    first = None
    async with client.post(url, json={**BODY, "stream": True}) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode()
            if first is None and '"content"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
    assert first is not None
    return first


def session(clients: int = 1) -> Any:
    import aiohttp  # the lightest client: the load generator shares the machine's cores

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients))


async def latency(direct: str, via: str, n: int, stream: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with session() as c:
        for _ in range(20):  # warm both paths (connections, the router's caches)
            await one(c, direct, stream)
            await one(c, via, stream)
        for _ in range(n):
            out["direct"].append(await one(c, direct, stream))
            out["gateway"].append(await one(c, via, stream))
    return out


async def throughput(url: str, clients: int, seconds: float) -> float:
    done = 0
    async with session(clients) as c:
        for _ in range(clients):
            await one(c, url, False)
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await one(c, url, False)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return done / (time.perf_counter() - start)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (load-independent, unlike wall time)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument(
        "--upstream-ms", type=int, default=0, help="the upstream's time per answer (default 0)"
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="gpulock-bench-serve-"))
    up_port, gw_port = free_port(), free_port()
    up_url = f"http://127.0.0.1:{up_port}/v1"
    config = tmp / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            routes:
              fast:
                - {{tier: cloud, backend: openai, model: m, base_url: {up_url},
                   api_key_env: {KEY_ENV}}}
            """
        )
    )
    env = {
        **os.environ,
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(tmp / "state"),
        KEY_ENV: "bench",
        "PYTHONPATH": str(REPO),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPSTREAM, str(up_port), str(args.upstream_ms)],
            env=env,
            start_new_session=True,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "gpulock", "serve", "--listen", f"127.0.0.1:{gw_port}"],
            env=env,
            start_new_session=True,
            stderr=subprocess.DEVNULL,
        ),
    ]
    results: dict[str, Any] = {}
    try:
        wait_up(f"{up_url}/models", procs[0])
        wait_up(f"http://127.0.0.1:{gw_port}/health", procs[1])
        direct = f"{up_url}/chat/completions"
        via = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        cpu0 = [cpu_s(p.pid) for p in procs]
        lat = asyncio.run(latency(direct, via, args.requests, False))
        cpu1 = [cpu_s(p.pid) for p in procs]
        # Per request through the gateway: the upstream served 2 requests (one direct, one
        # forwarded) per round, the gateway 1.
        n_req = args.requests + 20
        results["cpu_ms_per_request"] = {
            "upstream": (cpu1[0] - cpu0[0]) / (2 * n_req) * 1e3,
            "gateway": (cpu1[1] - cpu0[1]) / n_req * 1e3,
        }
        ttft = asyncio.run(latency(direct, via, args.requests // 2, True))
        rows = []
        for name, data in (("latency, non-streaming", lat), ("time to first token", ttft)):
            d50, d99 = pct(data["direct"], 0.5) * 1e3, pct(data["direct"], 0.99) * 1e3
            g50, g99 = pct(data["gateway"], 0.5) * 1e3, pct(data["gateway"], 0.99) * 1e3
            rows.append((name, d50, d99, g50, g99))
            results[name] = {"direct_ms": [d50, d99], "gateway_ms": [g50, g99]}
        tput = {}
        for n in (1, 8, 64):
            # Alternating slices, so that both paths see the same (shared, changing) load.
            slices = 4
            ds: list[float] = []
            gs: list[float] = []
            for _ in range(slices):
                ds.append(asyncio.run(throughput(direct, n, args.seconds / slices)))
                gs.append(asyncio.run(throughput(via, n, args.seconds / slices)))
            tput[n] = (statistics.mean(ds), statistics.mean(gs))
        results["throughput_rps"] = {str(n): list(v) for n, v in tput.items()}
        hwm = vm_hwm_kib(procs[1].pid)
        results["gateway_vm_hwm_kib"] = hwm
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()

    load1 = os.getloadavg()[0]
    print(
        f"\ngpulock serve vs the same upstream called directly ({os.cpu_count()} CPUs, "
        f"load average {load1:.1f}; the upstream answers after {args.upstream_ms} ms)\n"
    )
    print("| measurement | direct p50 / p99 | via gpulock serve p50 / p99 | added p50 / p99 |")
    print("| --- | --- | --- | --- |")
    for name, d50, d99, g50, g99 in rows:
        print(
            f"| {name} | {d50:.2f} / {d99:.2f} ms | {g50:.2f} / {g99:.2f} ms | "
            f"{g50 - d50:.2f} / {g99 - d99:.2f} ms |"
        )
    print("\n| concurrent clients | direct req/s | via gpulock serve req/s | ratio |")
    print("| --- | --- | --- | --- |")
    for n, (d, g) in tput.items():
        print(f"| {n} | {d:.0f} | {g:.0f} | {100 * g / d:.0f} % |")
    mem = f"{hwm / 1024:.0f} MiB" if hwm else "?"
    cpu = results["cpu_ms_per_request"]
    print(
        f"\nCPU per request (non-streaming): gateway {cpu['gateway']:.2f} ms, upstream "
        f"{cpu['upstream']:.2f} ms; gateway peak RSS (VmHWM): {mem}"
    )
    added = rows[0][3] - rows[0][1]
    ttft_added = rows[1][3] - rows[1][1]
    ratio = tput[64][1] / tput[64][0]
    verdict = [
        ("added p50 <= 2 ms", added <= 2.0),
        ("TTFT overhead <= 5 ms", ttft_added <= 5.0),
        ("64 clients >= 90 %", ratio >= 0.9),
    ]
    failed = [n for n, ok in verdict if not ok]
    print(
        f"\nsummary: gpulock serve adds {added:.2f} ms p50 ({rows[0][4] - rows[0][2]:.2f} ms p99) "
        f"non-streaming, {ttft_added:.2f} ms to the first token; throughput "
        + ", ".join(f"{n}: {100 * g / d:.0f} %" for n, (d, g) in tput.items())
        + f" of direct; gateway CPU {cpu['gateway']:.2f} ms/request; RSS {mem}; "
        + ("PASS" if not failed else "FAILED: " + ", ".join(failed))
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
