"""vLLM (API of v0.11, ``vllm/entrypoints/serve/sleep/api_router.py``): sleep mode.

One server serves one model (``GET /v1/models``).  Freeing it without stopping the server is
sleep level 1 (weights to host memory, KV cache dropped):

* ``POST /sleep?level=1&mode=wait`` -- ``mode=wait`` lets running requests finish; the
  default, ``abort``, kills them, so it is never used here.
* ``POST /wake_up``, ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``.
* These exist only when the server runs with ``VLLM_SERVER_DEV_MODE=1`` and
  ``--enable-sleep-mode``; a 404 says so, in words, instead of "not found".
* In use and last use: its Prometheus ``GET /metrics``: ``vllm:num_requests_running`` above 0
  is a request being served; ``vllm:request_success_total`` moves with every request served
  (the usage fingerprint).  Without ``/metrics`` both are unknown.
"""

from __future__ import annotations

from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import TenantError, TenantHttpError, items, obj


def metric_sum(text: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples (all label sets) in an exposition text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        try:
            total += float(line.rsplit(None, 1)[1])
            found = True
        except (ValueError, IndexError):
            continue
    return total if found else None


NO_SLEEP = (
    "vLLM has no sleep endpoints: start it with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"
)


class VllmAdapter(Adapter):
    kind = "vllm"

    def list(self) -> Seen:
        body = obj(self.client.get("/v1/models"), "GET /v1/models")
        names = [
            m["id"] for m in items(body.get("data", []), "data") if isinstance(m.get("id"), str)
        ]
        notes: tuple[str, ...] = ()
        try:
            sleeping = obj(self.client.get("/is_sleeping"), "GET /is_sleeping").get("is_sleeping")
        except TenantHttpError as e:
            if e.status != 404:
                raise
            sleeping, notes = None, (NO_SLEEP,)
        state = "sleeping" if sleeping is True else "loaded"
        running, served = self._metrics()
        models = tuple(
            TenantModel(
                name=n, state=state, in_use=None if running is None else running > 0,
                fingerprint=None if served is None else f"{served:g}",
            )
            for n in names
        )  # fmt: skip
        return Seen(actual_kind="vllm", models=models, notes=notes)

    def _metrics(self) -> tuple[float | None, float | None]:
        """(requests running, requests served) from ``/metrics``; None where not reported."""
        try:
            text = self.client.request("GET", "/metrics", expect_json=False)
        except TenantError:
            return None, None
        return metric_sum(text, "vllm:num_requests_running"), metric_sum(
            text, "vllm:request_success_total"
        )

    def _call(self, path: str, timeout_s: float) -> None:
        try:
            self.client.request("POST", path, None, timeout_s=timeout_s, expect_json=False)
        except TenantHttpError as e:
            if e.status == 404:
                raise TenantHttpError(NO_SLEEP, status=404) from None
            raise

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        self._call("/sleep?level=1&mode=wait", timeout_s)
        return "asleep (level 1)"

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        self._call("/wake_up", timeout_s)

    def health(self) -> str | None:
        try:
            self.client.request("GET", "/health", expect_json=False)
        except TenantError as e:
            return str(e)
        return None
