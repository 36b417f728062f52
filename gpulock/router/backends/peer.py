"""A cluster peer's ``gpulock serve``, through its OpenAI API (``gpulock.router.peers`` chose it).

The request waits in the peer's line like any of the peer's own, under the agent's name
(``X-Gpulock-Agent``), with what is left of the deadline (``X-Gpulock-Deadline``);
``X-Gpulock-From`` tells the peer to run it itself (no second hop).  The key this host
presents (``cluster.api_key_env``) is sent only when set: a peer on loopback needs none.

A frozen peer still accepts connections and reads the request: only silence tells.  So each
read (the response headers first, then each piece of a stream) may take at most
``cluster.peer_timeout`` past the call's expected start there (``start_s``, what the placement
estimated: its line, its load, the remote penalty), and never more than ``peer_timeout`` past
the caller's deadline; a peer silent for longer fails the call as a timeout, and the router
moves on along the route (``gpulock.router.model``), marking the peer failing for every caller
of this host until its heartbeat moves (``gpulock.cluster.failing``).
"""

from __future__ import annotations

import os
from typing import Any

from gpulock.router.backends import Result
from gpulock.router.backends.openai_api import OpenAIBackend, _openai
from gpulock.router.routes import Candidate

FROM_HEADER = "X-Gpulock-From"  # a forwarded request: the peer runs it itself (no second hop)


def silence_s(
    peer_timeout_s: float, start_s: float | None, wait_s: float | None, timeout_s: float
) -> float:
    """How long the peer may send nothing (pure): ``peer_timeout`` past the expected start,
    at most ``peer_timeout`` past the deadline (``wait_s``: what is left of it, None: none),
    and never longer than the candidate's own ``timeout``."""
    silent = peer_timeout_s + (start_s or 0.0)
    if wait_s is not None:
        silent = min(silent, wait_s + peer_timeout_s)
    return max(0.1, min(silent, timeout_s))


class PeerBackend(OpenAIBackend):
    def __init__(self, c: Candidate, *, agent: str, me: str, peer_timeout_s: float) -> None:
        super().__init__(c)
        self.agent = agent
        self.me = me
        self.peer_timeout_s = peer_timeout_s
        self.start_s: float | None = None  # the expected start of the call about to be made

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

    # A whole answer is asked of the peer as a stream all the same: its headers then come
    # with the first piece (the call has started), not after the last one, so that a long
    # answer is not taken for a silent peer.
    def complete(self, prompt: str, *, wait_s: float | None, label: str, **kw: Any) -> Result:
        return self._whole("text", prompt, wait_s, label, kw)

    def chat(
        self, messages: list[dict[str, Any]], *, wait_s: float | None, label: str, **kw: Any
    ) -> Result:
        return self._whole("chat", messages, wait_s, label, kw)

    def _whole(
        self, kind: str, payload: Any, wait_s: float | None, label: str, kw: dict[str, Any]
    ) -> Result:
        usage: dict[str, int] = {}
        pieces = self.stream(kind, payload, wait_s=wait_s, label=label, usage=usage, **kw)
        text = "".join(pieces)
        return Result(text, usage.get("tokens_in", 0), usage.get("tokens_out", 0))

    def stream(self, kind: str, payload: Any, *, wait_s: float | None, **kw: Any) -> Any:
        return super().stream(kind, payload, wait_s=wait_s, **self._limits(wait_s, kw))

    def _limits(self, wait_s: float | None, kw: dict[str, Any]) -> dict[str, Any]:
        """The call's keywords with the deadline header and the silence bound added."""
        import httpx  # the openai client's own transport: there when openai is

        out = dict(kw)
        if wait_s is not None:
            headers = {**(kw.get("extra_headers") or {}), "X-Gpulock-Deadline": f"{wait_s:.3f}s"}
            out["extra_headers"] = headers
        silent = silence_s(self.peer_timeout_s, self.start_s, wait_s, self.candidate.timeout_s)
        out.setdefault("timeout", httpx.Timeout(silent))
        return out
