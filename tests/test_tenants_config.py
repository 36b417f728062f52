"""The ``tenants:`` section: validated with file:line:key errors; a pasted key never echoed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpulock.core.config import parse_config
from gpulock.core.errors import ConfigError


def parse(text: str) -> object:
    return parse_config(text, "/etc/gpulock/config.yaml")


def test_a_full_tenants_list_is_read() -> None:
    cfg = parse(
        """
default_gpu: 1
tenants:
  - {name: ollama, kind: ollama, url: "http://127.0.0.1:11434", pinned: [embed], min_idle: 5m}
  - {name: llama, kind: llama-server, url: "http://127.0.0.1:8080/", gpu: 0,
     api_key_env: LLAMA_KEY}
  - name: tts
    kind: command
    command: [python, -m, tts_server, --port, 8090]
    url: "http://127.0.0.1:8090"
    need: 2GiB
    ready_timeout: 30s
"""
    )
    ollama, llama, tts = cfg.tenants  # type: ignore[attr-defined]
    assert (ollama.gpu, ollama.pinned, ollama.min_idle_s) == (1, ("embed",), 300.0)
    assert (llama.url, llama.gpu, llama.api_key_env) == ("http://127.0.0.1:8080", 0, "LLAMA_KEY")
    assert tts.command == ("python", "-m", "tts_server", "--port", "8090")
    assert tts.need_bytes == 2 * 1024**3 and tts.models == ("tts",)
    assert tts.health_url == "http://127.0.0.1:8090/health"
    assert (tts.ready_timeout_s, tts.stop_timeout_s) == (30.0, 10.0)
    assert cfg.exclusive_clears_tenants is True  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "key", "words"),
    [
        ("  - {name: a, kind: olama, url: 'http://x:1'}", "tenants[0].kind", "expected one of"),
        ("  - {name: a, kind: ollama}", "tenants[0].url", "base URL"),
        ("  - {name: a, kind: ollama, url: 'file:///etc/passwd'}", "tenants[0].url", "http://"),
        (
            "  - {name: a, kind: ollama, url: 'http://x:1', need: 1GiB}",
            "tenants[0].need",
            "command",
        ),
        (
            "  - {name: a, kind: ollama, url: 'http://x:1', colour: red}",
            "tenants[0].colour",
            "unknown",
        ),
        (
            "  - {name: a, kind: command, url: 'http://x:1', command: 'srv --port 1', need: 1GiB}",
            "tenants[0].command",
            "argv",
        ),
        (
            "  - {name: a, kind: command, url: 'http://x:1', command: [srv]}",
            "tenants[0].need",
            "need",
        ),
        (
            "  - {name: a, kind: ollama, url: 'http://x:1'}\n  - {name: a, kind: vllm, url: 'http://y:2'}",
            "tenants[1].name",
            "duplicate",
        ),
        (
            "  - {name: a, kind: ollama, url: 'http://x:1', min_idle: soon}",
            "tenants[0].min_idle",
            "",
        ),
    ],
)
def test_mistakes_name_file_line_and_key(body: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse("tenants:\n" + body + "\n")
    assert e.value.key == key
    assert e.value.line is not None and e.value.line >= 2
    assert words in str(e.value)
    assert str(e.value).startswith("/etc/gpulock/config.yaml:")


@pytest.mark.parametrize(
    "secret", ["sk-proj-abcdefghijklmnopqrstuvwxyz012345", "a8F3kQ9zL2mN7xV4bR6tY1wE5uI0oP3s"]
)
def test_a_pasted_key_is_refused_without_being_echoed(secret: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(
            f"tenants:\n  - {{name: a, kind: ollama, url: 'http://x:1', api_key_env: {secret}}}\n"
        )
    assert e.value.key == "tenants[0].api_key_env"
    text = f"{e.value} {e.value.hint}"
    assert secret not in text and secret[:8] not in text


def test_exclusive_clears_tenants_must_be_a_boolean() -> None:
    assert parse("exclusive_clears_tenants: false\n").exclusive_clears_tenants is False  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as e:
        parse("exclusive_clears_tenants: sometimes\n")
    assert e.value.key == "exclusive_clears_tenants"


def test_a_config_without_tenants_never_imports_the_tenants_package(tmp_path: Path) -> None:
    code = (
        "import sys, gpulock.core.config as c; c.parse_config('default_gpu: 0\\n', 'x.yaml');"
        "import gpulock; print(sorted(m for m in sys.modules if m.startswith('gpulock.tenants')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
