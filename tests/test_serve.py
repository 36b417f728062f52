"""``gpulock serve`` through the official clients and raw HTTP: the OpenAI and Ollama shapes.

One real server for the module: its routes lead to the tiny llama.cpp model in the server's
own process on a simulated GPU (``chat``, ``tiny-gpu``), on the CPU (``tiny-cpu``), and to a
real ``python -m llama_cpp.server`` as an OpenAI-compatible candidate (``cloudy``).  Clients are
the official ``openai`` (sync, async, streaming) and ``ollama`` ones; raw shapes are read with
``http.client``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest
from procs import wait_until
from router_servers import LlamaServer, free_port
from serve_server import GatewayProc

from gpulock.router.tiny_model import ensure_tiny_llama
from gpulock.serve import config as serve_config

UPSTREAM_KEY = "upstream-test-key"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    root = tmp_path_factory.mktemp("serve")
    tiny = ensure_tiny_llama(root)
    upstream = LlamaServer(tiny, root / "llama-server.log", api_key=UPSTREAM_KEY).start()
    config = root / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            simulate: 24GiB
            serve: {{max_body: 64KiB}}
            routes:
              chat:
                - {{tier: gpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 8,
                   name: tiny-gpu}}
              cloudy:
                - {{tier: cloud, backend: openai, model: tiny, base_url: {upstream.base_url},
                   api_key_env: UPSTREAM_KEY, max_tokens: 8, name: llama-server}}
              cheap:
                - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 8,
                   name: tiny-cpu}}
            """
        )
    )
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(root / "state"),
        "UPSTREAM_KEY": UPSTREAM_KEY,
    }
    g = GatewayProc(root / "serve.log", env=env)
    try:
        yield g.start()
    finally:
        g.stop()
        upstream.stop()


def oa(g: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0)


# --- OpenAI ------------------------------------------------------------------------------------


def test_openai_client_chat_completions_embeddings_and_models(gateway: GatewayProc) -> None:
    c = oa(gateway)
    raw = c.chat.completions.with_raw_response.create(model="chat", messages=MSG)  # type: ignore[arg-type]
    assert raw.headers["x-gpulock-tier"] == "gpu"
    assert raw.headers["x-gpulock-model"] == "tiny-gpu"
    assert float(raw.headers["x-gpulock-waited-ms"]) >= 0
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == "chat"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"  # the tiny model always runs to max_tokens
    assert r.usage is not None and r.usage.completion_tokens == 8

    t = c.completions.create(model="tiny-cpu", prompt="Once", max_tokens=5)
    assert t.object == "text_completion" and t.choices[0].text
    assert t.usage is not None and t.usage.completion_tokens == 5

    # The client asks for base64 by default and decodes it; float on request.
    e = c.embeddings.create(model="chat", input=["one", "two"])
    assert len(e.data) == 2 and len(e.data[0].embedding) > 8
    f = c.embeddings.create(model="chat", input="one", encoding_format="float")
    assert f.data[0].embedding == pytest.approx(e.data[0].embedding, rel=1e-5)

    ids = [m.id for m in c.models.list()]
    assert ids[:3] == ["chat", "cloudy", "cheap"]  # tasks first
    assert set(ids[3:]) == {"tiny-gpu", "llama-server", "tiny-cpu"}


def test_openai_async_client_streams_with_usage(gateway: GatewayProc) -> None:
    async def run() -> tuple[list[str], object, list[str]]:
        c = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        pieces: list[str] = []
        usage = None
        stream = await c.chat.completions.create(
            model="chat",
            messages=MSG,
            stream=True,
            stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.content:
                    pieces.append(ch.delta.content)
        texts = []
        tstream = await c.completions.create(model="cheap", prompt="x", stream=True, max_tokens=4)
        async for chunk in tstream:
            texts.extend(ch.text for ch in chunk.choices if ch.text)
        await c.close()
        return pieces, usage, texts

    pieces, usage, texts = asyncio.run(run())
    assert len(pieces) == 8
    assert usage is not None and usage.completion_tokens == 8  # type: ignore[attr-defined]
    assert len(texts) == 4


def test_openai_sync_stream_and_a_real_openai_compatible_upstream(gateway: GatewayProc) -> None:
    c = oa(gateway)
    raw = c.chat.completions.with_raw_response.create(model="cloudy", messages=MSG)  # type: ignore[arg-type]
    assert raw.headers["x-gpulock-tier"] == "cloud"
    assert raw.headers["x-gpulock-model"] == "llama-server"
    assert raw.parse().choices[0].message.content
    chunks = list(c.chat.completions.create(model="cloudy", messages=MSG, stream=True))  # type: ignore[arg-type]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sse_ends_with_done(gateway: GatewayProc) -> None:
    r = gateway.request(
        "POST", "/v1/chat/completions", {"model": "chat", "messages": MSG, "stream": True}
    )
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# --- Ollama ------------------------------------------------------------------------------------


def test_ollama_client_chat_generate_embed_list_ps(gateway: GatewayProc) -> None:
    c = ollama.Client(host=gateway.url)
    r = c.chat(model="chat", messages=MSG, stream=False)
    assert r.message.role == "assistant" and r.message.content
    assert r.done and r.done_reason == "length" and r.eval_count == 8
    parts = list(c.chat(model="chat", messages=MSG, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts)
    g = c.generate(model="cheap", prompt="Once", options={"num_predict": 3})
    assert g.response and g.eval_count == 3
    assert "".join(p.response for p in c.generate(model="chat", prompt="Once", stream=True))
    e = c.embed(model="chat", input=["a", "b"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) > 8
    names = [m.model for m in c.list().models]
    assert names[:3] == ["chat", "cloudy", "cheap"]
    loaded = [m.model for m in c.ps().models]
    assert "tiny-gpu" in loaded


def test_ollama_client_errors(gateway: GatewayProc) -> None:
    c = ollama.Client(host=gateway.url)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="nope", messages=MSG)
    assert e.value.status_code == 404
    assert "chat" in e.value.error and "tiny-gpu" in e.value.error


# --- raw shapes --------------------------------------------------------------------------------


def test_small_endpoints(gateway: GatewayProc) -> None:
    r = gateway.request("GET", "/")
    assert (r.status, r.body) == (200, b"Ollama is running")
    assert "version" in gateway.request("GET", "/api/version").json()
    assert gateway.request("GET", "/health").json()["status"] == "ok"
    snap = gateway.request("GET", "/gpulock/status").json()
    assert snap["version"] == 1 and [g["gpu"] for g in snap["gpus"]] == [0]
    r = gateway.request("GET", "/v1/nothing")
    assert r.status == 404 and r.json()["error"]["message"].startswith("no such endpoint")


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", b'{"model": "chat", ', 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", b'{"model": "chat"}', 400, "'messages' is required"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "'model' is required"),
        ("/v1/completions", b'{"model": "chat", "prompt": 3}', 400, "'prompt' is required"),
        ("/v1/embeddings", b'{"model": "chat"}', 400, "'input' is required"),
        (
            "/v1/chat/completions",
            b'{"model": "nope", "messages": [{"role": "user"}]}',
            404,
            "known models: chat, cloudy, cheap, tiny-gpu",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "chta", "messages": [{"role": "user"}]}',
            404,
            "model 'chta' not found; did you mean 'chat'? known models: chat, cloudy, cheap",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "ollama/llama3", "messages": [{"role": "user"}]}',
            404,
            "no tenant 'ollama' (tenants: none configured)",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "chat", "messages": [{"role": "user"}]}' + b" " * 70000,
            413,
            "max_body",
        ),
    ],
)
def test_openai_errors_have_the_api_shape(
    gateway: GatewayProc, path: str, body: bytes, status: int, needle: str
) -> None:
    r = gateway.request("POST", path, raw=body)
    assert r.status == status, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"]
    assert "Traceback" not in gateway.output()


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/api/chat", b"{nope", 400),
        ("/api/chat", b'{"model": "chat"}', 400),
        ("/api/generate", b'{"model": "nope", "prompt": "x"}', 404),
        ("/api/embed", b'{"model": "chat"}', 400),
    ],
)
def test_ollama_errors_have_the_api_shape(
    gateway: GatewayProc, path: str, body: bytes, status: int
) -> None:
    r = gateway.request("POST", path, raw=body)
    assert r.status == status, r.body
    assert isinstance(r.json()["error"], str)


def test_deadline_header_must_be_a_duration(gateway: GatewayProc) -> None:
    r = gateway.request(
        "POST",
        "/v1/chat/completions",
        {"model": "chat", "messages": MSG},
        headers={"X-Gpulock-Deadline": "soon"},
    )
    assert r.status == 400 and "X-Gpulock-Deadline" in r.json()["error"]["message"]


def test_generate_with_an_empty_prompt_only_loads(gateway: GatewayProc) -> None:
    r = gateway.request("POST", "/api/generate", {"model": "chat"})
    assert r.json()["done_reason"] == "load" and r.json()["done"] is True


# --- keys ----------------------------------------------------------------------------------------


def test_keys_are_required_when_configured(tmp_path: Path) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text("serve: {api_keys_env: SERVE_KEYS}\n")
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(tmp_path / "state"),
        "SERVE_KEYS": "first-key-123, second-key-456",
    }
    g = GatewayProc(tmp_path / "serve.log", env=env).start()
    try:
        assert g.request("GET", "/v1/models").status == 401
        wrong = g.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert g.request("GET", "/api/tags").json() == {
            "error": "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)"
        }
        for key in ("first-key-123", "second-key-456"):
            ok = g.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status == 200
        c = openai.OpenAI(base_url=f"{g.url}/v1", api_key="second-key-456", max_retries=0)
        assert c.models.list().data == []
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{g.url}/v1", api_key="bad", max_retries=0).models.list()
    finally:
        g.stop()
    assert "first-key-123" not in g.output() and "second-key-456" not in g.output()


def test_non_loopback_listen_without_keys_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text("# every default\n")
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "serve", "--listen", f"0.0.0.0:{free_port()}"],
        env={
            "PATH": "/usr/bin:/bin",
            "GPULOCK_CONFIG": str(config),
            "GPULOCK_STATE_DIR": str(tmp_path / "state"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: refusing to listen on 0.0.0.0"), r.stderr
    assert "hint: set serve.api_keys_env" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag", ["--listen", "--port"])
def test_a_bare_port_listens_on_loopback(tmp_path: Path, flag: str) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text("# every default\n")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpulock", "serve", flag, str(port)],
            env={
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                "GPULOCK_CONFIG": str(config),
                "GPULOCK_STATE_DIR": str(tmp_path / "state"),
            },
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:

        def health() -> int | None:
            if proc.poll() is not None:
                raise AssertionError(f"gpulock serve {flag} {port} exited\n{log.read_text()}")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status
            except OSError:
                return None
            finally:
                conn.close()

        assert wait_until(health, 60.0, lambda: log.read_text()) == 200
        assert f"listening on http://127.0.0.1:{port}" in log.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("11435", ("127.0.0.1", 11435)),
        (":8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),  # noqa: S104 (parsed, not bound)
        ("[::1]:9", ("::1", 9)),
    ],
)
def test_parse_listen(text: str, where: tuple[str, int]) -> None:
    assert serve_config.parse_listen(text) == where


def test_listen_and_port_together_are_a_usage_error(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "serve", "--listen", "127.0.0.1:8000", "--port", "9"],
        env={"PATH": "/usr/bin:/bin", "GPULOCK_STATE_DIR": str(tmp_path / "state")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--listen and --port" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("serve: {listen: nowhere}\n", "serve.listen"),
        ("serve: {max_queue: 0}\n", "serve.max_queue"),
        ("serve: {api_keys_env: sk-abc123}\n", "serve.api_keys_env"),
        ("serve: {colour: blue}\n", "serve.colour"),
    ],
)
def test_bad_serve_config_names_the_key(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "serve", "--config", str(config)],
        env={"PATH": "/usr/bin:/bin", "GPULOCK_STATE_DIR": str(tmp_path / "state")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode in (1, 2), r.stderr
    assert needle in r.stderr and "gpulock.yaml:1:" in r.stderr and "Traceback" not in r.stderr
    assert "abc123" not in r.stderr


def test_metrics_on_serves_port_count_the_gateways_requests(gateway: GatewayProc) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def counted() -> float:
        r = gateway.request("GET", "/metrics")
        assert r.status == 200, r.body
        for fam in text_string_to_metric_families(r.body.decode()):
            if fam.name == "gpulock_gateway_request_duration_seconds":
                return sum(
                    s.value
                    for s in fam.samples
                    if s.name.endswith("_count")
                    and s.labels.get("task") == "cheap"
                    and s.labels.get("outcome") == "ok"
                )
        return 0.0

    before = counted()
    r = gateway.request(
        "POST", "/v1/chat/completions",
        body={"model": "cheap", "messages": [{"role": "user", "content": "hi"}]},
    )  # fmt: skip
    assert r.status == 200, r.body
    assert counted() == before + 1  # the event log is read at each scrape: no waiting needed
