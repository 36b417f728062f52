"""vLLM stand-in, following the API of vLLM v0.11 (``vllm/entrypoints/openai/api_server.py``
and ``vllm/entrypoints/serve/sleep/api_router.py``).

One served model (``GET /v1/models``); ``POST /v1/completions`` answers "hi", whole or, with
``stream: true``, as server-sent events.  With ``dev_mode`` (the server ran with
``VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode``): ``POST /sleep?level=N&mode=abort|wait``
(``abort``, the default, aborts the requests in flight -- counted in ``aborted`` -- ``wait``
lets them finish first), ``POST /wake_up``, ``GET /is_sleeping`` -> ``{"is_sleeping": b}``.
Without it those paths are 404 ``{"detail": "Not Found"}``, as FastAPI answers.  ``GET /metrics``
is Prometheus text with ``vllm:num_requests_running`` and ``vllm:request_success_total``
(labelled by ``model_name``; the counter also per ``finished_reason``).
"""

from __future__ import annotations

from typing import Any

from standins.base import Sse, StandIn


class Vllm(StandIn):
    def __init__(self, model: str, *, dev_mode: bool = True) -> None:
        super().__init__()
        self.model = model
        self.dev_mode = dev_mode
        self.sleeping = False
        self.inflight = 0
        self.aborted = 0
        self.served = 0

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if path == "/health":
            return 200, ""
        if method == "GET" and path == "/metrics":
            label = f'model_name="{self.model}"'
            served = float(self.served)
            return 200, (
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{{label}}} {float(self.inflight)}\n"
                "# TYPE vllm:request_success_total counter\n"
                f'vllm:request_success_total{{finished_reason="stop",{label}}} {served}\n'
                f'vllm:request_success_total{{finished_reason="length",{label}}} 0.0\n'
            )
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if method == "POST" and path == "/v1/completions":
            with self.lock:
                self.inflight += 1
            try:
                self.generating()
            finally:
                with self.lock:
                    self.inflight -= 1
                    self.served += 1
            if isinstance(body, dict) and body.get("stream"):
                # As vLLM's OpenAI server streams a completion: a chunk a piece, the last one
                # with its finish_reason, then usage when stream_options.include_usage says so.
                chunks = [
                    {"object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": "hi", "finish_reason": None}]},
                    {"object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
                ]  # fmt: skip
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
                    chunks.append({"object": "text_completion", "choices": [], "usage": usage})
                return 200, Sse(chunks)
            return 200, {"choices": [{"text": "hi"}]}
        if not self.dev_mode or path not in ("/sleep", "/wake_up", "/is_sleeping"):
            return 404, {"detail": "Not Found"}
        if method == "GET" and path == "/is_sleeping":
            return 200, {"is_sleeping": self.sleeping}
        if method == "POST" and path == "/sleep":
            if query.get("mode", "abort") == "abort":
                with self.lock:
                    self.aborted += self.inflight
            else:
                self.hold.wait(30)  # mode=wait: the requests in flight finish first
            self.sleeping = True
            return 200, ""
        if method == "POST" and path == "/wake_up":
            self.sleeping = False
            return 200, ""
        return 405, {"detail": "Method Not Allowed"}
