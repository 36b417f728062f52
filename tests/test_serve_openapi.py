"""``GET /openapi.json``: the document covers every route of the app, its request bodies are the
very schemas the handlers validate with, and Schemathesis, fuzzing a live ``gpulock serve``
from it, finds no 5xx, no response out of the document, and leaves no traceback in the log."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from router_servers import FaultServer
from serve_server import GatewayProc, stand_in_gateway

from gpulock.core.settings import load
from gpulock.router.routes import load_table
from gpulock.serve import schema
from gpulock.serve.app import build_app
from gpulock.serve.dispatch import Dispatcher
from gpulock.serve.line import Line
from gpulock.serve.openapi import document

EXAMPLES = 10  # per operation and phase; the document has 24 operations
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,negative_data_rejection"
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    root = tmp_path_factory.mktemp("openapi")
    up = FaultServer(mode="ok").start()
    g = stand_in_gateway(root, up.base_url)
    try:
        yield g.start()
    finally:
        g.stop()
        up.stop()


def app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    settings = load(None, tmp_path / "state")
    d = Dispatcher(settings, load_table(settings.config), Line(settings, 1))
    app: Any = build_app(settings, d, keys=(), max_body=1)
    out = set()
    for r in app.app.routes:  # KeyCheck wraps the Starlette app
        for m in r.methods - {"HEAD"}:
            out.add((r.path, m.lower()))
    return out


def test_every_route_is_in_the_document_and_nothing_else(tmp_path: Path) -> None:
    doc = document()
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert documented == app_routes(tmp_path)
    assert doc["openapi"] == "3.1.0"


def test_request_bodies_are_the_schemas_the_handlers_validate_with() -> None:
    paths = document(["chat"])["paths"]
    for path, shape in [
        ("/v1/chat/completions", schema.OPENAI_CHAT),
        ("/v1/completions", schema.OPENAI_COMPLETION),
        ("/v1/embeddings", schema.OPENAI_EMBEDDINGS),
        ("/v1/responses", schema.RESPONSES),
        ("/v1/messages", schema.ANTHROPIC_MESSAGES),
        ("/api/chat", schema.OLLAMA_CHAT),
        ("/api/generate", schema.OLLAMA_GENERATE),
        ("/api/embed", schema.OLLAMA_EMBED),
        ("/api/embeddings", schema.OLLAMA_EMBEDDINGS),
        ("/api/show", schema.OLLAMA_SHOW),
    ]:
        published = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        published["properties"]["model"].pop("examples")
        assert published == shape, path


def test_schemathesis_finds_nothing_against_a_live_server(
    gateway: GatewayProc, tmp_path: Path
) -> None:
    assert gateway.request("GET", "/openapi.json").json()["paths"]
    argv = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{gateway.url}/openapi.json",
        "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--workers", "1", "--seed", "20",
        "--no-color", "--generation-database", "none", "--request-timeout", "30",
    ]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = p.stdout + p.stderr
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert p.returncode == 0 and counts is not None, out[-6000:]
    print(f"\nschemathesis: {counts.group(0)}")
    assert counts.group(1) == counts.group(2)
    assert "Traceback" not in gateway.output(), gateway.output()
