"""``gpulock serve`` in front of an upstream, side by side with calling the upstream directly,
with the code before this work, with the accounting's limits on, and with LiteLLM's proxy.

Run: ``.venv/bin/python bench/serve.py [--requests N] [--seconds S] [--upstream-ms MS]
[--before REV] [--no-limits] [--no-litellm] [--json FILE]``  (~3 min)

The upstream is a minimal OpenAI-compatible server (Starlette on uvicorn, in its own process):
``/v1/chat/completions`` answers a fixed completion, or streams 16 chunks, after
``--upstream-ms`` (20) milliseconds asleep (off this machine's CPU, as a model computing on a
GPU), so that what is measured is the gateway, not a model.  Each gateway is a real ``gpulock
serve`` (its own process and state folder) whose route ``fast`` is that server as an
OpenAI-compatible (cloud-tier) candidate: each request is parsed, routed (the router's probe
and choice), admitted and recorded by the accounting, forwarded over a kept-alive connection,
and its answer re-rendered.  The gateways, each a column:

* ``gpulock serve``: this checkout, a route without limits;
* ``gpulock serve, limits``: the same with a ``rate_limit`` and a ``daily_budget`` on the route
  (none refuses: every request is admitted, reserved and settled against them; serve takes
  them from the shared ledger in blocks, ``gpulock.router.blocks``);
* ``before (REV)`` and ``before (REV), limits``: the code of ``--before`` (default ``ea3e100``,
  before issue 31's work on the request path), exported from this checkout's history, on
  asyncio's own loop as this code runs (uvicorn would take uvloop where it is installed);
* ``LiteLLM``: its proxy (``litellm[proxy]``, no database), installed by this benchmark into its
  own virtual environment under ``~/.cache/gpulock-bench/litellm`` (``$XDG_CACHE_HOME``
  respected; never a dependency of gpulock), skipped with a message where it cannot be
  installed, or with ``--no-litellm``.  Its CPU and memory are those of its whole process tree.

The clients are ``aiohttp`` sessions in this process.

(a) Added latency, non-streaming: ``--requests`` (300) sequential chat requests, every path in
    turn; p50 / p99 of each.
(b) Time to first token, streaming: the same, to the first content chunk.
(c) Throughput at 1, 8 and 64 concurrent clients for ``--seconds`` (4) each, in four alternating
    slices (each path in turn): requests per second of each, and its share of direct's.
(d) CPU per request at 64 clients: each process tree's user + system CPU over its slices, per
    request served (from ``/proc``: unlike wall time, not the machine's load).
(e) Each gateway's peak resident set (VmHWM) after the run.
(f) The agent APIs: ``/v1/responses`` and ``/v1/messages`` beside ``/v1/chat/completions``
    through the same gateway and upstream (latency, the gateway's CPU per request), and each
    API's own translation (schema check, request to ``Ask``, answer or 16-piece stream back in
    its shape) timed in this process: target <= 0.1 ms of CPU added per request.

Everything shares this machine's cores (clients, gateways and upstream): on 2 cores the
throughput ratio at 64 clients measures CPU more than waiting.  Targets for ``gpulock serve``:
<= 2 ms added p50, <= 5 ms TTFT overhead, >= 90 % of direct throughput and <= 0.40 ms of CPU a
request at 64 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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

    # Every request carries LiteLLM's key (its proxy refuses to start without one); the upstream
    # and gpulock serve (keys off) ignore it, so all paths send the same bytes.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=clients),
        headers={"Authorization": f"Bearer {LITELLM_KEY}"},
    )


async def latency(urls: dict[str, str], n: int, stream: bool) -> dict[str, list[float]]:
    """``n`` rounds, each calling every url once in turn: seconds per call, by name."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    async with session() as c:
        for _ in range(20):  # warm every path (connections, the router's caches)
            for url in urls.values():
                await one(c, url, stream)
        for _ in range(n):
            for name, url in urls.items():
                out[name].append(await one(c, url, stream))
    return out


async def throughput(
    url: str, clients: int, seconds: float, cpu: Any = None
) -> tuple[int, float, float]:
    """Requests answered in ``seconds`` by ``clients`` at once, the seconds it took, and the
    CPU seconds ``cpu()`` (a process tree's CPU so far) grew by meanwhile: the warm-up (a
    request per client, one after another: each opens its connection) is left out of it."""
    done = 0
    async with session(clients) as c:
        for _ in range(clients):
            await one(c, url, False)
        cpu0 = cpu() if cpu is not None else 0.0
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await one(c, url, False)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        took = time.perf_counter() - start
        return done, took, (cpu() - cpu0) if cpu is not None else 0.0


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


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a server started with ``start_new_session``)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(d))
    return pids


def tree_cpu_s(sid: int) -> float:
    total = 0.0
    for pid in session_pids(sid):
        try:
            total += cpu_s(pid)
        except OSError:
            pass
    return total


def tree_hwm_kib(sid: int) -> int | None:
    sizes = [vm_hwm_kib(p) for p in session_pids(sid)]
    known = [k for k in sizes if k is not None]
    return sum(known) if known else None


# --- the agent APIs: Responses and Messages beside chat completions --------------------------

API_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat completions": ("/v1/chat/completions", BODY),
    "Responses": ("/v1/responses", {"model": "fast", "input": "hello", "max_output_tokens": 16}),
    "Messages": (
        "/v1/messages",
        {"model": "fast", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]},
    ),
}
TRANSLATION_TARGET_US = 100.0  # the added cost of a face's translation, CPU per request


def translation_cpu_us(n: int) -> dict[str, dict[str, float]]:
    """CPU microseconds per request of each API's own work in this process, for a whole
    answer and for a 16-piece stream: check the body against its schema, translate it into
    the one ``Ask``, render the answer (or every event of the stream) in the API's shape.
    Everything else a request costs (routing, the line, the upstream call, accounting) is the
    same code for the three APIs."""
    sys.path.insert(0, str(REPO))
    from gpulock.serve import api_anthropic, api_openai, api_responses, schema, validator
    from gpulock.serve.engines import Answer, Usage

    shapes = {
        "chat completions": schema.OPENAI_CHAT,
        "Responses": schema.RESPONSES,
        "Messages": schema.ANTHROPIC_MESSAGES,
    }
    answer = Answer("hi there", Usage(3, 2, "stop"))

    def whole(name: str, body: dict[str, Any]) -> Any:
        if name == "chat completions":
            a = api_openai.chat_ask(body)
            return api_openai.answer(a, a.model, answer)
        if name == "Responses":
            a = api_responses.ask(body)
            return api_responses.answer(a, body, answer)
        a = api_anthropic.ask(body)
        return api_anthropic.answer(a, answer)

    async def pieces() -> Any:
        for i in range(16):
            yield f"w{i} "

    def events(name: str, body: dict[str, Any]) -> Any:
        u = Usage(3, 16, "stop")
        if name == "chat completions":
            a = api_openai.chat_ask(body)
            return api_openai.sse(a, a.model, pieces(), u, False)
        if name == "Responses":
            a = api_responses.ask(body)
            return api_responses.sse(a, body, pieces(), u)
        return api_anthropic.sse(api_anthropic.ask(body), pieces(), u)

    async def drain(gen: Any) -> None:
        async for _ in gen:
            pass

    out: dict[str, dict[str, float]] = {}
    for name, (_path, body) in API_BODIES.items():
        data = json.dumps(body).encode()
        for _ in range(200):  # warm
            json.dumps(whole(name, validator.loads(data)))
        t0 = time.process_time()
        for _ in range(n):
            obj = validator.loads(data)
            validator.validate(obj, shapes[name])
            json.dumps(whole(name, obj))
        t1 = time.process_time()

        async def streams(name: str = name, data: bytes = data) -> None:
            for _ in range(n // 4):
                obj = validator.loads(data)
                validator.validate(obj, shapes[name])
                await drain(events(name, {**obj, "stream": True}))

        t2 = time.process_time()
        asyncio.run(streams())
        t3 = time.process_time()
        out[name] = {"whole_us": (t1 - t0) / n * 1e6, "stream_us": (t3 - t2) / (n // 4) * 1e6}
    return out


async def api_latency(gw: str, n: int) -> dict[str, list[float]]:
    """``n`` rounds through the gateway, each API once per round in turn: seconds per call."""
    out: dict[str, list[float]] = {name: [] for name in API_BODIES}
    async with session() as c:
        for i in range(n + 20):
            for name, (path, body) in API_BODIES.items():
                start = time.perf_counter()
                async with c.post(gw + path, json=body) as r:
                    r.raise_for_status()
                    json.loads(await r.read())
                if i >= 20:  # the first 20 rounds warm every path
                    out[name].append(time.perf_counter() - start)
    return out


def api_rows(gw: str, gw_pid: int, n: int) -> tuple[list[str], str, dict[str, Any]]:
    """The Responses and Messages rows beside chat completions: the table's lines, the
    summary's clause, the figures.  Latency through the gateway (the same upstream answers
    all three), the gateway's CPU per request in a run of each API alone, and the faces' own
    translation cost measured in this process (see ``translation_cpu_us``)."""
    lat = asyncio.run(api_latency(gw, n))
    cpu: dict[str, float] = {}
    for name, (path, body) in API_BODIES.items():

        async def alone(path: str = path, body: dict[str, Any] = body) -> None:
            async with session() as c:
                for _ in range(n):
                    async with c.post(gw + path, json=body) as r:
                        await r.read()

        c0 = cpu_s(gw_pid)
        asyncio.run(alone())
        cpu[name] = (cpu_s(gw_pid) - c0) / n * 1e3
    own = translation_cpu_us(max(2000, n * 20))
    base = own["chat completions"]
    lines = [
        "| API (non-streaming through the gateway) | p50 / p99 | gateway CPU / request "
        "| translation CPU, whole / 16-piece stream | added vs chat completions |",
        "| --- | --- | --- | --- | --- |",
    ]
    added: dict[str, float] = {}
    for name in API_BODIES:
        p50, p99 = pct(lat[name], 0.5) * 1e3, pct(lat[name], 0.99) * 1e3
        t = own[name]
        extra = max(t["whole_us"] - base["whole_us"], t["stream_us"] - base["stream_us"])
        added[name] = extra
        plus = "(the baseline)" if name == "chat completions" else f"{extra:+.1f} us"
        lines.append(
            f"| {name} | {p50:.2f} / {p99:.2f} ms | {cpu[name]:.2f} ms | "
            f"{t['whole_us']:.1f} / {t['stream_us']:.1f} us | {plus} |"
        )
    worst = max(added["Responses"], added["Messages"])
    ok = worst <= TRANSLATION_TARGET_US
    clause = (
        f"Responses adds {added['Responses']:.1f} us and Messages {added['Messages']:.1f} us of "
        f"translation CPU per request over chat completions (target <= "
        f"{TRANSLATION_TARGET_US:.0f} us)"
    )
    figures = {
        "latency_ms": {k: [pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3] for k, v in lat.items()},
        "gateway_cpu_ms": cpu,
        "translation_us": own,
        "added_us": added,
        "ok": ok,
    }
    return lines, clause, figures


LITELLM_SPEC = "litellm[proxy]"
LITELLM_KEY = "sk-" + secrets.token_hex(16)  # its master key, for this run only


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each process's group (each was started in a session of its own) and reap it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def litellm_venv() -> tuple[Path | None, str]:
    """LiteLLM's proxy in its own virtual environment under the cache folder, installed on
    first use: (its ``litellm`` command, "") or (None, why it is skipped)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "gpulock-bench" / "litellm"
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe, ""
    print(f"installing {LITELLM_SPEC} into {venv} (once; a few minutes) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", LITELLM_SPEC]
        r = subprocess.run(pip, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not create its virtual environment ({e})"
    if r.returncode != 0 or not exe.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"pip install {LITELLM_SPEC} failed: {tail[0][:200]}"
    return exe, ""


def start_litellm(exe: Path, up_url: str, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        "model_list:\n  - model_name: fast\n    litellm_params:\n"
        f"      model: openai/m\n      api_base: {up_url}\n      api_key: bench\n"
        "litellm_settings:\n  telemetry: false\n"
    )
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_MASTER_KEY": LITELLM_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet at start
    }
    return subprocess.Popen(
        [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", "1"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


BEFORE_REV = "ea3e100"  # the code before issue 31's work on serve's request path


def export_rev(rev: str, tmp: Path) -> tuple[Path | None, str]:
    """The tree of ``rev`` (this checkout's history) in a folder of its own: (its path, "")
    or (None, why it is left out)."""
    dest = tmp / f"rev-{rev}"
    dest.mkdir()
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "gpulock"], capture_output=True, timeout=60
        )
        if archive.returncode != 0:
            return None, f"git archive {rev}: {archive.stderr.decode().strip()[:200]}"
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not export {rev} ({e})"
    return dest, ""


def gateway_config(tmp: Path, name: str, up_url: str, limits: bool) -> Path:
    """A gateway's config: route ``fast`` to the upstream; ``limits``: the accounting's
    checks on (a rate limit and a daily budget no run comes near, so none refuses)."""
    extra = ", rate_limit: 10000000, daily_budget: 1000000, price: 0.001" if limits else ""
    config = tmp / f"{name}.yaml"
    config.write_text(
        "routes:\n  fast:\n"
        f"    - {{tier: cloud, backend: openai, model: m, base_url: {up_url},\n"
        f"       api_key_env: {KEY_ENV}{extra}}}\n"
    )
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument(
        "--upstream-ms", type=int, default=20, help="the upstream's time per answer (default 20)"
    )
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument(
        "--no-litellm", action="store_true", help="leave out LiteLLM's proxy (the third column)"
    )
    ap.add_argument(
        "--before",
        default=BEFORE_REV,
        metavar="REV",
        help=f"the code to compare with, from this checkout's history (default {BEFORE_REV}; "
        "'none' leaves it out)",
    )
    ap.add_argument(
        "--no-limits", action="store_true", help="leave out the gateways with the accounting on"
    )
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="gpulock-bench-serve-"))
    up_port, lite_port = free_port(), free_port()
    up_url = f"http://127.0.0.1:{up_port}/v1"
    base_env = {**os.environ, KEY_ENV: "bench"}
    lite_exe, skipped = (None, "--no-litellm") if args.no_litellm else litellm_venv()
    before_tree, before_skipped = (None, "--before none") if args.before == "none" else (
        export_rev(args.before, tmp)
    )  # fmt: skip
    # The gateways: (name, the tree its gpulock comes from, the accounting's limits on).
    gateways: list[tuple[str, Path, bool]] = [("gpulock serve", REPO, False)]
    if not args.no_limits:
        gateways.append(("gpulock serve, limits", REPO, True))
    if before_tree is not None:
        gateways.append((f"before ({args.before})", before_tree, False))
        if not args.no_limits:
            gateways.append((f"before ({args.before}), limits", before_tree, True))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPSTREAM, str(up_port), str(args.upstream_ms)],
            env={**base_env, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
    ]
    urls = {"direct": f"{up_url}/chat/completions"}
    by_name: dict[str, subprocess.Popen[bytes]] = {"direct": procs[0]}
    # Both on asyncio's own loop: this code asks uvicorn for it, the code before would take
    # uvloop where it is installed.
    no_uvloop = tmp / "no-uvloop" / "uvloop"
    no_uvloop.mkdir(parents=True)
    (no_uvloop / "__init__.py").write_text("raise ImportError('not in this extra')\n")
    for i, (name, tree, limits) in enumerate(gateways):
        port = free_port()
        path = str(tree) if tree == REPO else f"{no_uvloop.parent}{os.pathsep}{tree}"
        env = {
            **base_env,
            "GPULOCK_CONFIG": str(gateway_config(tmp, f"g{i}", up_url, limits)),
            "GPULOCK_STATE_DIR": str(tmp / f"state{i}"),
            "PYTHONPATH": path,
        }
        p = subprocess.Popen(
            [sys.executable, "-m", "gpulock", "serve", "--listen", f"127.0.0.1:{port}"],
            env=env,
            cwd=str(tree),
            start_new_session=True,
            stderr=subprocess.DEVNULL,
        )
        procs.append(p)
        by_name[name] = p
        urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
    if lite_exe is not None:
        procs.append(start_litellm(lite_exe, up_url, lite_port, tmp))
    results: dict[str, Any] = {"gateways": [g[0] for g in gateways]}
    try:
        wait_up(f"{up_url}/models", procs[0])
        for name, _tree, _limits in gateways:
            wait_up(urls[name].replace("/v1/chat/completions", "/health"), by_name[name])
        if lite_exe is not None:
            try:
                wait_up(f"http://127.0.0.1:{lite_port}/health/liveliness", procs[-1])
                urls["LiteLLM"] = f"http://127.0.0.1:{lite_port}/v1/chat/completions"
                by_name["LiteLLM"] = procs[-1]
            except SystemExit as e:
                skipped = f"its proxy did not start ({e})"
        names = list(urls)
        lat = asyncio.run(latency(urls, args.requests, False))
        ttft = asyncio.run(latency(urls, args.requests // 2, True))
        rows = []
        for what, data in (("latency, non-streaming", lat), ("time to first token", ttft)):
            row = {n: (pct(data[n], 0.5) * 1e3, pct(data[n], 0.99) * 1e3) for n in names}
            rows.append((what, row))
            results[what] = {n: list(v) for n, v in row.items()}
        tput: dict[int, dict[str, float]] = {}
        cpu: dict[str, float] = {}
        for n in (1, 8, 64):
            # Alternating slices, so that every path sees the same (shared, changing) load.
            slices = 4
            got: dict[str, list[float]] = {name: [] for name in names}
            spent = dict.fromkeys(names, 0.0)
            served = dict.fromkeys(names, 0)
            for _ in range(slices):
                for name in names:
                    pid = by_name[name].pid
                    done, took, used = asyncio.run(
                        throughput(
                            urls[name], n, args.seconds / slices, lambda p=pid: tree_cpu_s(p)
                        )
                    )
                    spent[name] += used
                    served[name] += done
                    got[name].append(done / took)
            tput[n] = {name: statistics.mean(v) for name, v in got.items()}
            if n == 64:  # CPU per request under load: what the gateway costs a busy machine
                cpu = {name: spent[name] / max(1, served[name]) * 1e3 for name in names}
        results["throughput_rps"] = {str(n): v for n, v in tput.items()}
        results["cpu_ms_per_request_at_64"] = cpu
        hwm = {n: tree_hwm_kib(by_name[n].pid) for n in names[1:]}
        results["vm_hwm_kib"] = hwm
        gw = "gpulock serve"
        api_lines, api_clause, results["apis"] = api_rows(
            urls[gw].removesuffix("/v1/chat/completions"),
            by_name[gw].pid,
            max(100, args.requests // 2),
        )
    finally:
        kill_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)

    proxies = names[1:]
    load1 = os.getloadavg()[0]
    print(
        f"\n{', '.join(proxies)} vs the same upstream called directly ({os.cpu_count()} CPUs, "
        f"load average {load1:.1f}; the upstream answers after {args.upstream_ms} ms; "
        "'limits': the route has a rate limit and a daily budget, so every request is admitted, "
        "reserved and settled against them)\n"
    )
    for what, why in (("LiteLLM", skipped), ("before", before_skipped)):
        if why:
            print(f"({what}'s columns are left out: {why})\n")
    print("| measurement | " + " | ".join(f"{p} p50 / p99" for p in names) + " |")
    print("|" + " --- |" * (1 + len(names)))
    for what, row in rows:
        print(
            f"| {what} | "
            + " | ".join(f"{row[p][0]:.2f} / {row[p][1]:.2f} ms" for p in names)
            + " |"
        )
    print("\n| concurrent clients | " + " | ".join(f"{p} req/s" for p in names) + " |")
    print("|" + " --- |" * (1 + len(names)))
    for n, v in tput.items():
        d = v["direct"]
        cells = [f"{d:.0f}"] + [f"{v[p]:.0f} ({100 * v[p] / d:.0f} %)" for p in proxies]
        print(f"| {n} | " + " | ".join(cells) + " |")

    def mib(k: int | None) -> str:
        return f"{k / 1024:.0f} MiB" if k else "?"

    print(
        "\nCPU per request at 64 clients: "
        + ", ".join(f"{p} {cpu[p]:.3f} ms" for p in proxies)
        + f", upstream (direct) {cpu['direct']:.3f} ms; peak RSS (VmHWM): "
        + ", ".join(f"{p} {mib(hwm[p])}" for p in proxies)
    )
    print("\nThe agent APIs beside chat completions, through the same gateway and upstream:\n")
    print("\n".join(api_lines))
    g = "gpulock serve"
    added = rows[0][1][g][0] - rows[0][1]["direct"][0]
    added99 = rows[0][1][g][1] - rows[0][1]["direct"][1]
    ttft_added = rows[1][1][g][0] - rows[1][1]["direct"][0]
    ratio = tput[64][g] / tput[64]["direct"]
    verdict = [
        ("added p50 <= 2 ms", added <= 2.0),
        ("TTFT overhead <= 5 ms", ttft_added <= 5.0),
        ("64 clients >= 90 %", ratio >= 0.9),
        ("CPU <= 0.40 ms/request at 64 clients", cpu[g] <= 0.40),
        (f"API translation <= {TRANSLATION_TARGET_US:.0f} us", results["apis"]["ok"]),
    ]
    gl = "gpulock serve, limits"
    if gl in cpu:  # the same targets with the accounting's limits on
        verdict.append(("with limits 64 clients >= 90 %", tput[64][gl] / tput[64]["direct"] >= 0.9))
        verdict.append(("with limits CPU <= 0.40 ms/request at 64 clients", cpu[gl] <= 0.40))
    failed = [n for n, ok in verdict if not ok]
    others = []
    for p in proxies[1:]:
        others.append(
            f"{p}: {100 * tput[64][p] / tput[64]['direct']:.0f} % at 64 clients, "
            f"CPU {cpu[p]:.3f} ms/request"
        )
    if "LiteLLM" not in proxies:
        others.append(f"LiteLLM left out ({skipped})")
    print(
        f"\nsummary: gpulock serve adds {added:.2f} ms p50 ({added99:.2f} ms p99) non-streaming, "
        f"{ttft_added:.2f} ms to the first token; throughput "
        + ", ".join(f"{n}: {100 * v[g] / v['direct']:.0f} %" for n, v in tput.items())
        + f" of direct; gateway CPU {cpu[g]:.3f} ms/request at 64 clients; RSS {mib(hwm[g])}; "
        + "; ".join([api_clause, *others])
        + "; "
        + ("PASS" if not failed else "FAILED: bench/serve.py (" + ", ".join(failed) + ")")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
