"""Which candidates can call tools (a pure function), and tool calls in one shape.

An agent's request with ``tools`` goes only to a candidate that can call them: one that cannot
is skipped with the reason (``gpulock.router.choose``), so the route falls back instead of
answering without them.

* ``backend: openai`` (the cloud tier, or any OpenAI-compatible server): the tools are passed to
  it, as the chat completions' API has them.
* ``backend: tenant``: passed to the tenant's own API when its kind takes tools (Ollama,
  llama.cpp's llama-server, vLLM, LocalAI, llama-swap); ComfyUI's and a ``kind: command``
  tenant's server are not known to, unless the candidate says ``tools: true``.
* ``backend: llama_cpp``: through one of llama-cpp-python's function-calling chat handlers: the
  one the candidate names (``tools: chatml-function-calling``), else ``chatml-function-calling``
  when the model's own chat template (in its GGUF) is ChatML; no other template has a handler
  (the model's template would at best render the tools, and nothing parses its calls back out).

``tools: false`` says a candidate calls none, whatever its kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpulock.router.routes import Candidate
from gpulock.router.routevalues import TOOL_HANDLERS as HANDLERS

TENANT_KINDS = frozenset({"ollama", "llama-server", "llama-swap", "vllm", "localai"})
CHATML = "<|im_start|>"


@dataclass(frozen=True, slots=True)
class ToolSupport:
    """Whether a candidate can call tools; ``how`` it does, or why it cannot."""

    ok: bool
    how: str
    handler: str | None = None  # llama.cpp in this process: the chat handler that calls them

    def __str__(self) -> str:
        return f"tools: {self.how}" if self.ok else f"cannot call tools: {self.how}"


def support(
    c: Candidate, *, tenant_kind: str | None = None, template: str | None = None
) -> ToolSupport:
    """``c``'s tool support; ``tenant_kind``: the kind of its tenant (backend ``tenant``);
    ``template``: its GGUF's chat template (backend ``llama_cpp``; None: none, or unread)."""
    if c.tools is False:
        return ToolSupport(False, f"tools: false ({c.key}.tools)")
    if c.backend == "openai":
        return ToolSupport(True, "passed to the endpoint")
    if c.backend == "tenant":
        if c.tools is True:
            return ToolSupport(True, f"passed to tenant {c.tenant} ({c.key}.tools)")
        if tenant_kind in TENANT_KINDS:
            return ToolSupport(True, f"passed to tenant {c.tenant} ({tenant_kind})")
        return ToolSupport(
            False,
            f"tenant {c.tenant} ({tenant_kind or 'unknown kind'}) is not known to take tools; "
            f"say tools: true in {c.key} if its server does",
        )
    if isinstance(c.tools, str):
        return ToolSupport(True, f"llama.cpp handler {c.tools}", c.tools)
    if template is not None and CHATML in template:
        return ToolSupport(
            True, "llama.cpp handler chatml-function-calling, for its ChatML template", HANDLERS[0]
        )
    what = "no chat template" if template is None else "a chat template that is not ChatML"
    return ToolSupport(False, f"{what}; name a handler in tools: if the model follows one")


def summary(named: list[tuple[str, ToolSupport]]) -> str:
    """One line: which candidates can call tools and how, which cannot and why (candidates
    with the same answer grouped), for ``gpulock route --explain``."""
    groups: dict[tuple[bool, str], list[str]] = {}
    for name, s in named:
        names = groups.setdefault((s.ok, s.how), [])
        if name not in names:
            names.append(name)
    parts = [
        f"{'can' if ok else 'cannot'}: {', '.join(names)} ({how})"
        for (ok, how), names in groups.items()
    ]
    return "tools: " + "; ".join(parts)


def tool_calls_of(message: Any) -> tuple[dict[str, Any], ...]:
    """The tool calls of an assistant ``message`` (OpenAI's shape, or Ollama's: arguments as
    an object, no id), each as ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` with the arguments as JSON text and an id made up where none was given."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    out = []
    for i, call in enumerate(calls if isinstance(calls, list) else []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args if args is not None else {})
        given = call.get("id")
        out.append(
            {
                "id": given if isinstance(given, str) and given else f"call_{i}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return tuple(out)
