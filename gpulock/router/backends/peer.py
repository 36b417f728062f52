"""A cluster peer's ``gpulock serve``, through its OpenAI API (``gpulock.router.peers`` chose it).

The request waits in the peer's line like any of the peer's own, under the agent's name
(``X-Gpulock-Agent``), with what is left of the deadline (``X-Gpulock-Deadline``);
``X-Gpulock-From`` tells the peer to run it itself (no second hop).  The key this host
presents (``cluster.api_key_env``) is sent only when set: a peer on loopback needs none.
"""

from __future__ import annotations

import os
from typing import Any

from gpulock.router.backends.openai_api import OpenAIBackend, _openai
from gpulock.router.routes import Candidate

FROM_HEADER = "X-Gpulock-From"  # a forwarded request: the peer runs it itself (no second hop)


class PeerBackend(OpenAIBackend):
    def __init__(self, c: Candidate, *, agent: str, me: str) -> None:
        super().__init__(c)
        self.agent = agent
        self.me = me

    def _get(self) -> Any:
        if self._client is None:
            c = self.candidate
            key = os.environ.get(c.api_key_env or "") or "none"  # the client wants one
            self._client = _openai().OpenAI(
                base_url=c.base_url,
                api_key=key,
                timeout=c.timeout_s,
                max_retries=0,
                default_headers={"X-Gpulock-Agent": self.agent, FROM_HEADER: self.me},
            )
        return self._client

    def complete(self, prompt: str, *, wait_s: float | None, label: str, **kw: Any) -> Any:
        return super().complete(prompt, wait_s=wait_s, label=label, **_deadline(wait_s, kw))

    def chat(
        self, messages: list[dict[str, Any]], *, wait_s: float | None, label: str, **kw: Any
    ) -> Any:
        return super().chat(messages, wait_s=wait_s, label=label, **_deadline(wait_s, kw))

    def stream(self, kind: str, payload: Any, *, wait_s: float | None, **kw: Any) -> Any:
        return super().stream(kind, payload, wait_s=wait_s, **_deadline(wait_s, kw))


def _deadline(wait_s: float | None, kw: dict[str, Any]) -> dict[str, Any]:
    if wait_s is None:
        return kw
    headers = {**(kw.get("extra_headers") or {}), "X-Gpulock-Deadline": f"{wait_s:.3f}s"}
    return {**kw, "extra_headers": headers}
