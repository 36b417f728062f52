"""Which candidates can call tools: ``gpulock.router.tools.support`` as a table, the chooser's
use of it (a request with tools skips the others, saying why), the GGUF chat template read
from the header, the ``tools:`` key's errors, and ``gpulock route --explain / --tools``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_router_choose import cand

from gpulock.core.config import load_config
from gpulock.core.errors import ConfigError
from gpulock.core.gguf import read_chat_template
from gpulock.router.choose import Host, choose
from gpulock.router.routes import load_table
from gpulock.router.tiny_model import CHAT_TEMPLATE, ensure_tiny_llama
from gpulock.router.tools import support, tool_calls_of

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"


@pytest.mark.parametrize(
    ("fields", "kind", "template", "ok", "handler", "needle"),
    [
        ({"tier": "cloud"}, None, None, True, None, "passed to the endpoint"),
        ({"tier": "cloud", "tools": False}, None, None, False, None, "tools: false"),
        ({"backend": "tenant", "tenant": "ol"}, "ollama", None, True, None, "tenant ol (ollama)"),
        ({"backend": "tenant", "tenant": "cf"}, "comfyui", None, False, None, "tools: true"),
        ({"backend": "tenant", "tenant": "cm", "tools": True}, "command", None, True, None, "cm"),
        ({}, None, CHATML, True, "chatml-function-calling", "its ChatML template"),
        ({}, None, CHAT_TEMPLATE, False, None, "not ChatML"),
        ({}, None, None, False, None, "no chat template"),
        ({"tools": "functionary-v2"}, None, None, True, "functionary-v2", "handler functionary"),
        ({"tools": False}, None, CHATML, False, None, "tools: false"),
    ],
)
def test_support(
    fields: dict[str, Any],
    kind: str | None,
    template: str | None,
    ok: bool,
    handler: str | None,
    needle: str,
) -> None:
    s = support(cand(**fields), tenant_kind=kind, template=template)
    assert (s.ok, s.handler) == (ok, handler)
    assert needle in s.how, s.how


def test_a_request_with_tools_skips_candidates_that_cannot_call_them() -> None:
    plain = cand("routes.t[0]", tier="cpu")
    tooled = cand("routes.t[1]", tier="cpu", tools="chatml-function-calling")
    host = Host(tools_of=lambda c: support(c, template=CHAT_TEMPLATE))
    assert choose("t", [plain, tooled], host).candidate is plain  # no tools: as before
    choice = choose("t", [plain, tooled], host, tools=True)
    assert choice.candidate is tooled
    assert choice.chosen is not None and choice.chosen.tool_handler == "chatml-function-calling"
    assert "cannot call tools: a chat template that is not ChatML" in (choice.verdicts[0].reason)
    none = choose("t", [plain], host, tools=True)
    assert none.chosen is None and "cannot call tools" in none.explain()


def test_the_chat_template_is_read_from_the_gguf_header(tmp_path: Path) -> None:
    tiny = ensure_tiny_llama(tmp_path)
    assert read_chat_template(str(tiny)) == CHAT_TEMPLATE
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    assert read_chat_template(str(junk)) is None  # damaged: no template, the load says why
    assert read_chat_template(str(tmp_path / "missing.gguf")) is None


@pytest.mark.parametrize(
    ("candidate", "needle"),
    [
        ("{tier: cpu, backend: llama_cpp, model: m.gguf, tools: chatml-function-caling}",
         "did you mean"),
        ("{tier: cloud, backend: openai, model: m, base_url: http://x, api_key_env: K, "
         "tools: chatml-function-calling}", "expected true or false"),
    ],
)  # fmt: skip
def test_a_wrong_tools_value_names_the_key(tmp_path: Path, candidate: str, needle: str) -> None:
    path = tmp_path / "gpulock.yaml"
    path.write_text(f"routes:\n  t:\n    - {candidate}\n")
    with pytest.raises(ConfigError) as e:
        load_table(load_config(str(path)))
    text = str(e.value) + (e.value.hint or "")
    assert "routes.t[0].tools" in text and needle in text, text


def test_tool_calls_of_takes_openai_and_ollama_shapes() -> None:
    openai_shape = {"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}
    ollama_shape = {"tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    assert tool_calls_of(openai_shape)[0]["id"] == "c1"
    (call,) = tool_calls_of(ollama_shape)
    assert call["id"] == "call_0" and json.loads(call["function"]["arguments"]) == {"a": 1}
    assert tool_calls_of({"content": "x"}) == () and tool_calls_of(None) == ()


def test_route_explain_says_which_candidates_can_call_tools(tmp_path: Path) -> None:
    tiny = ensure_tiny_llama(tmp_path)
    config = tmp_path / "gpulock.yaml"
    config.write_text(
        "routes:\n  agent:\n"
        f"    - {{tier: cpu, backend: llama_cpp, model: {tiny}, name: plain}}\n"
        f"    - {{tier: cpu, backend: llama_cpp, model: {tiny}, name: tooled,\n"
        "       tools: chatml-function-calling}\n"
    )
    base = [sys.executable, "-m", "gpulock", "route", "agent", "--config", str(config)]
    base += ["--state-dir", str(tmp_path / "state")]
    out = subprocess.run([*base, "--explain"], capture_output=True, text=True, check=True).stdout
    assert "agent: cpu plain" in out
    assert out.splitlines()[-1] == (
        "tools: cannot: plain (a chat template that is not ChatML; name a handler in tools: if "
        "the model follows one); can: tooled (llama.cpp handler chatml-function-calling)"
    )
    r = subprocess.run([*base, "--tools", "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(r.stdout)
    assert doc["chosen"]["name"] == "tooled" and doc["chosen"]["tools"]["ok"] is True
    assert doc["candidates"][0]["tools"]["ok"] is False
    assert "cannot call tools" in doc["candidates"][0]["reason"]
