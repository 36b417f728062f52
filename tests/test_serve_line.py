"""``gpulock serve``'s requests in the same per-GPU line as ``gpulock run`` jobs.

A real server whose routes lead to the tiny llama.cpp model in its own process on a simulated
GPU; real ``gpulock run`` jobs and ``procs.py`` holders in the same state folder.  Orders are
read from the event log (``acquire`` events are written in grant order), never from timings.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import DEFAULT_WAIT_S, Child, World, wait_until
from serve_server import GatewayProc, Reply

from gpulock.router.tiny_model import ensure_tiny_llama

WAIT_S = 60.0
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def start(world: World, tiny: Path) -> Iterator[Callable[..., GatewayProc]]:
    started: list[GatewayProc] = []

    def run(
        *, parallel: int = 1, n_ctx: int = 256, extra: str = "", simulate: str = "24GiB"
    ) -> GatewayProc:
        gpu = f"{{tier: gpu, backend: llama_cpp, model: {tiny}, n_ctx: {n_ctx}, max_tokens: 8"
        cpu = f"{{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 8"
        world.config.write_text(
            f"simulate: {simulate}\n"
            + textwrap.dedent(extra)
            + "routes:\n"
            + f"  chat:\n    - {gpu}, name: tiny-gpu, parallel: {parallel}}}\n"
            + f"  fallback:\n    - {gpu}, name: tiny-gpu}}\n    - {cpu}, name: tiny-cpu}}\n"
        )
        g = GatewayProc(world.root / "serve.log").start()
        started.append(g)
        return g

    try:
        yield run
    finally:
        for g in started:
            g.stop()


def chat(g: GatewayProc, agent: str, **extra: Any) -> Reply:
    headers = {"X-Gpulock-Agent": agent, **extra.pop("headers", {})}
    return g.request(
        "POST", "/v1/chat/completions", {"model": "chat", "messages": MSG, **extra}, headers
    )


class Background:
    """Requests sent from threads, their replies kept."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.replies: dict[str, Reply | BaseException] = {}

    def send(self, name: str, fn: Callable[[], Reply]) -> None:
        def run() -> None:
            try:
                self.replies[name] = fn()
            except BaseException as e:
                self.replies[name] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(WAIT_S)


def ticket_of(world: World, name: str) -> int:
    return wait_until(
        lambda: next((s for s, t in world.tickets().items() if t.name == name), None),
        WAIT_S,
        lambda: f"a ticket named {name}\n{world.describe()}",
    )


def run_job(world: World, name: str, *cmd: str) -> Child:
    argv = [sys.executable, "-m", "gpulock", "run", "--name", name, "--", *(cmd or ("true",))]
    child = Child(world, name, argv)
    world.children.append(child)
    child.seq = ticket_of(world, name)
    return child


def acquired(world: World) -> list[str]:
    return [e["name"] for e in world.events("acquire")]


def test_http_requests_and_run_jobs_are_granted_in_arrival_order(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start()
    holder = world.hold("holder")
    bg = Background()
    bg.send("r1", lambda: chat(g, "r1"))
    ticket_of(world, "r1")
    # Seen as a waiter under its agent's name, in the status the server itself serves.
    gpu0 = g.request("GET", "/gpulock/status").json()["gpus"][0]
    assert [w["name"] for w in gpu0["waiters"]] == ["r1"]
    assert [h["name"] for h in gpu0["holders"]] == ["holder"]
    j1 = run_job(world, "j1")
    bg.send("r2", lambda: chat(g, "r2"))
    ticket_of(world, "r2")
    j2 = run_job(world, "j2")
    holder.release()
    bg.join()
    assert j1.wait_exit(WAIT_S) == 0 and j2.wait_exit(WAIT_S) == 0
    for name in ("r1", "r2"):
        r = bg.replies[name]
        assert isinstance(r, Reply) and r.status == 200, r
    assert acquired(world) == ["holder", "r1", "j1", "r2", "j2"]
    # Each HTTP request held its ticket under its agent's name, with the model's size as need.
    needs = {e["name"]: e["need_bytes"] for e in world.events("acquire")}
    assert needs["r1"] and needs["r2"] and needs["j1"] is None
    wait_until(lambda: world.tickets() == {}, WAIT_S, "an empty queue")


def test_a_stream_of_requests_lets_a_waiting_job_in_after_the_running_one(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start()
    stop = threading.Event()
    done: list[int] = []

    def client() -> None:
        while not stop.is_set():
            r = chat(g, "streamer")
            done.append(r.status)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    waited: list[str] = []
    try:
        wait_until(lambda: len(done) >= 3, WAIT_S, "the stream of requests to run")
        # A job may come in a gap between two tickets of the stream and hold at once: nothing
        # to see then; jobs come until five of them had to wait behind the stream.
        for i in range(40):
            argv = [sys.executable, "-m", "gpulock", "run", "--name", f"job{i}", "--", "true"]
            job = Child(world, f"job{i}", argv)
            world.children.append(job)
            assert job.wait_exit(WAIT_S) == 0
            if world.events("wait", name=f"job{i}"):
                waited.append(f"job{i}")
            if len(waited) == 5:
                break
        after = len(done)
        wait_until(lambda: len(done) >= after + 3, WAIT_S, "requests after the jobs")
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S)
    assert set(done) == {200}
    assert waited, "no job ever had to wait behind the stream"
    # In the order they happened: a busy gateway writes its events in batches (a few ms
    # late), so the log's order across processes is not theirs; their times are.
    events = sorted(world.events(), key=lambda e: e["ts"])
    for name in waited:
        i_wait = next(i for i, e in enumerate(events) if e["event"] == "wait" and e["name"] == name)
        i_acq = next(
            i for i, e in enumerate(events) if e["event"] == "acquire" and e["name"] == name
        )
        calls = [e for e in events[i_wait:i_acq] if e["event"] == "call"]
        # Only requests already in line ahead of the job (under tickets taken before its own)
        # finish before it holds: none joined a ticket of the stream once the job waited.
        job_seq = events[i_acq]["ticket"]
        assert all(e["ticket"] < job_seq for e in calls), (name, job_seq, calls)
        # ...and at most one per such ticket (parallel: 1).
        assert len(calls) <= len({e["ticket"] for e in calls}), (name, calls)


def test_requests_share_one_ticket_up_to_parallel(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start(parallel=2, n_ctx=1024)
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=WAIT_S)
    body = {"model": "chat", "messages": MSG, "stream": True, "max_tokens": 500}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"X-Gpulock-Agent": "a"})
    first = conn.getresponse()
    assert first.status == 200
    first.readline()  # the stream holds its slot (and the model) while we do not read
    bg = Background()
    bg.send("b", lambda: chat(g, "b"))
    wait_until(
        lambda: g.request("GET", "/health").json()["running"] == 2,
        WAIT_S,
        "the second request to run under the first one's ticket",
    )
    assert [t.name for t in world.tickets().values()] == ["a"]
    assert g.request("GET", "/health").json()["waiting"] == 0
    first.read()
    conn.close()
    bg.join()
    r = bg.replies["b"]
    assert isinstance(r, Reply) and r.status == 200
    assert float(r.headers["x-gpulock-waited-ms"]) >= 0
    assert acquired(world) == ["a"]  # one ticket for both


def raw_request(g: GatewayProc, body: dict[str, Any], agent: str) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", g.port), timeout=WAIT_S)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Gpulock-Agent: {agent}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def test_a_client_that_hangs_up_while_waiting_leaves_the_line_at_once(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start()
    holder = world.hold("holder")
    s = raw_request(g, {"model": "chat", "messages": MSG}, "leaver")
    seq = ticket_of(world, "leaver")
    s.close()
    wait_until(lambda: seq not in world.tickets(), WAIT_S, "the ticket to leave")
    gone = world.gpu_dir() / f"{seq:012d}.fifo"
    assert not gone.exists()
    holder.release()
    assert chat(g, "after").status == 200
    assert "leaver" not in acquired(world)


def test_a_client_that_hangs_up_mid_stream_frees_the_gpu_at_once(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start(n_ctx=2048)
    body = {"model": "chat", "messages": MSG, "stream": True, "max_tokens": 1800}
    s = raw_request(g, body, "quitter")
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    s.close()
    world.wait_event("release", WAIT_S, name="quitter")
    assert world.tickets() == {}
    # The answer did not run to its end: its call is counted with what the client got, as
    # router.get_model counts a stream its caller stopped reading (its event written behind).
    [call] = wait_until(
        lambda: [e for e in world.events("call") if e.get("agent") == "quitter"],
        WAIT_S,
        "the call event of the client that hung up",
    )
    assert call["client_gone"] is True and 1 <= call["tokens_out"] < 1800
    assert chat(g, "after").status == 200


def test_a_full_queue_answers_429_with_retry_after(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start(extra="serve: {max_queue: 2}\n")
    holder = world.hold("holder")
    bg = Background()
    for name in ("w1", "w2"):
        bg.send(name, lambda name=name: chat(g, name))  # type: ignore[misc]
        ticket_of(world, name)
    r = chat(g, "w3")
    assert r.status == 429 and r.headers["retry-after"].isdigit()
    assert r.json()["error"]["code"] == "queue_full"
    o = g.request("POST", "/api/chat", {"model": "chat", "messages": MSG})
    assert o.status == 429 and isinstance(o.json()["error"], str)
    holder.release()
    bg.join()
    assert all(isinstance(r, Reply) and r.status == 200 for r in bg.replies.values())


def test_a_deadline_falls_back_along_the_route_else_504(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    # The chooser believes a hold lasts 10 ms, so the GPU is tried; the line then runs out.
    g = start(extra="router: {hold_estimate: 0.01s}\n")
    holder = world.hold("holder")
    r = g.request(
        "POST",
        "/v1/chat/completions",
        {"model": "fallback", "messages": MSG},
        {"X-Gpulock-Deadline": "1s", "X-Gpulock-Agent": "hurried"},
    )
    assert r.status == 200, r.body
    assert (r.headers["x-gpulock-tier"], r.headers["x-gpulock-model"]) == ("cpu", "tiny-cpu")
    assert world.events("fallback", agent="hurried")
    r = chat(g, "hurried", headers={"X-Gpulock-Deadline": "0.5"})
    assert r.status == 504, r.body
    assert r.json()["error"]["code"] == "deadline_exceeded"
    holder.release()
    wait_until(lambda: not world.tickets(), DEFAULT_WAIT_S, "an empty queue")


def test_the_governors_level_applies(world: World, start: Callable[..., GatewayProc]) -> None:
    import os
    import time

    from gpulock.core import claim, level

    g = start(n_ctx=2048)
    s = world.settings()
    fd = claim.create(level.claim_path(s), 0o600)  # the test plays a running governor
    try:

        def publish(lvl: str) -> None:
            now = time.time()
            level.write(s, level.Published(lvl, now, now, 60.0, os.getpid()))

        publish("freeze")  # new GPU work waits: GPU candidates are passed over
        r = chat(g, "frozen")
        assert r.status == 503 and "freeze" in r.json()["error"]["message"]
        r = g.request("POST", "/v1/chat/completions", {"model": "fallback", "messages": MSG})
        assert r.status == 200 and r.headers["x-gpulock-tier"] == "cpu"
        publish("reduce")  # contexts are halved
        r = chat(g, "reduced")
        assert r.status == 200 and r.headers["x-gpulock-tier"] == "gpu"
        loads = world.events("model-load", model="tiny-gpu")
        assert [e["n_ctx"] for e in loads] == [1024]
    finally:
        os.close(fd)


def test_a_client_that_hangs_up_during_a_whole_answer_frees_the_gpu(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start(n_ctx=2048)
    s = raw_request(g, {"model": "chat", "messages": MSG, "max_tokens": 1800}, "abandon")
    seq = ticket_of(world, "abandon")
    wait_until(
        lambda: (t := world.tickets().get(seq)) is not None and t.holding,
        WAIT_S,
        "the request to hold the GPU",
    )
    s.close()
    world.wait_event("release", WAIT_S, name="abandon")
    assert world.tickets() == {}
    assert chat(g, "after").status == 200


def test_the_models_serve_keeps_are_residents_the_governor_can_evict(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    import subprocess

    g = start()
    assert chat(g, "warm").status == 200
    assert [m["name"] for m in g.request("GET", "/api/ps").json()["models"]] == ["tiny-gpu"]
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "evict", "tiny-gpu", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert g.request("GET", "/api/ps").json()["models"] == []
    assert chat(g, "again").status == 200  # loaded again for the next request
    assert len(world.events("model-load", model="tiny-gpu")) == 2


def test_the_chat_and_the_embeddings_instance_of_one_model_are_named_apart(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    import subprocess

    g = start()
    assert chat(g, "warm").status == 200
    r = g.request("POST", "/v1/embeddings", {"model": "chat", "input": "one"})
    assert r.status == 200, r.body
    status = subprocess.run(
        [sys.executable, "-m", "gpulock", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    names = sorted(m["name"] for m in json.loads(status.stdout)["residents"])
    assert names == ["tiny-gpu", "tiny-gpu:embed"], names
    # Each can be evicted by its own name, and only that one leaves.
    r2 = subprocess.run(
        [sys.executable, "-m", "gpulock", "evict", "tiny-gpu:embed", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert [x["name"] for x in json.loads(r2.stdout)["results"]] == ["tiny-gpu:embed"]


def test_a_deadline_that_runs_out_waiting_for_a_busy_model_is_a_504_not_an_error(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    # The chooser believes the GPU frees in 10 ms; the model's one slot stays taken by a long
    # answer (8000 tokens: seconds, even for the tiny model), so the second request waits for
    # that slot under the same ticket, past its deadline.
    g = start(n_ctx=8192, extra="router: {hold_estimate: 0.01s}\n")
    s = raw_request(g, {"model": "chat", "messages": MSG, "max_tokens": 8000}, "long")
    seq = ticket_of(world, "long")
    wait_until(
        lambda: (t := world.tickets().get(seq)) is not None and t.holding,
        WAIT_S,
        "the long request to hold the GPU",
    )
    r = chat(g, "late", headers={"X-Gpulock-Deadline": "0.5"})
    assert r.status == 504, r.body
    assert r.json()["error"]["code"] == "deadline_exceeded"
    r = g.request(
        "POST",
        "/v1/chat/completions",
        {"model": "fallback", "messages": MSG},
        {"X-Gpulock-Deadline": "0.5", "X-Gpulock-Agent": "late"},
    )
    assert r.status == 200 and r.headers["x-gpulock-tier"] == "cpu", r.body
    assert [t.name for t in world.tickets().values()] == ["long"]  # "late" took no ticket
    s.close()
    world.wait_event("release", WAIT_S, name="long")


def test_a_deadline_504_for_a_candidates_name_names_that_candidate(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    g = start(extra="router: {hold_estimate: 0.01s}\n")
    holder = world.hold("holder")
    body = {"model": "tiny-gpu", "messages": MSG}
    r = g.request("POST", "/v1/chat/completions", body, {"X-Gpulock-Deadline": "0.5"})
    assert r.status == 504, r.body
    message = r.json()["error"]["message"]
    assert message.startswith("no model for 'tiny-gpu' (of task "), message
    holder.release()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_server_answers_its_waiters_releases_its_tickets_and_exits_0(
    world: World, start: Callable[..., GatewayProc], sig: str
) -> None:
    """SIGTERM (systemd's stop) and SIGINT (Ctrl-C): the request waiting for the GPU is
    answered 503, its ticket leaves the line, the server says it stopped and exits 0 (it
    died of the signal before: 143, 130)."""
    import os
    import signal

    g = start()
    assert g.proc is not None
    holder = world.hold("holder")
    bg = Background()
    bg.send("waiter", lambda: chat(g, "waiter"))
    ticket_of(world, "waiter")
    os.kill(g.proc.pid, getattr(signal, sig))
    assert g.proc.wait(WAIT_S) == 0, g.output()
    bg.join()
    r = bg.replies["waiter"]
    assert isinstance(r, Reply) and r.status == 503, r
    assert "gpulock serve is stopping" in r.json()["error"]["message"]
    assert f"gpulock serve: stopped ({sig})" in g.output()
    assert "Traceback" not in g.output()
    assert [t.name for t in world.tickets().values()] == ["holder"]  # the waiter's is gone
    holder.release()


def test_on_two_gpus_a_request_waits_in_one_line_and_runs_where_granted(
    world: World, start: Callable[..., GatewayProc]
) -> None:
    """Several GPUs (issue 28): a request for a local model without gpu: takes a ticket for
    both, is granted the one that frees, and the model loads there; the next request prefers
    the GPU where the server has it loaded."""
    g = start(simulate="24GiB,24GiB")
    h0 = world.hold("h0", gpu=0)
    h1 = world.hold("h1", gpu=1)
    bg = Background()
    bg.send("r1", lambda: chat(g, "r1"))
    world.wait_event("wait", name="r1")
    gpus = g.request("GET", "/gpulock/status").json()["sets"]
    assert [[w["name"] for w in s["waiters"]] for s in gpus] == [["r1"]]
    h1.release()
    bg.join()
    r = bg.replies["r1"]
    assert isinstance(r, Reply) and r.status == 200, r
    (acq,) = world.events("acquire", name="r1")
    assert (acq["gpus"], acq["granted"]) == ([0, 1], [1])
    h0.release()  # both free now: the warm one is taken
    assert chat(g, "r2").status == 200
    (acq2,) = world.events("acquire", name="r2")
    assert acq2["granted"] == [1]
    assert len(world.events("model-load")) == 1
