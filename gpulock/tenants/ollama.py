"""Ollama (API of v0.12, ``docs/api.md``): ``GET /api/ps``, ``POST /api/generate`` keep_alive.

* Listing: ``/api/ps`` -> ``{"models": [{"name", "model", "size", "size_vram",
  "expires_at", ...}]}``.  ``size_vram`` is the part on the GPU (the rest is in host memory).
* Unload: ``POST /api/generate {"model": M, "keep_alive": 0}`` answers at once, but Ollama frees
  the model only when its in-flight requests end; meanwhile ``/api/ps`` still lists it with
  ``expires_at`` in the past.  Such an entry is ``unloading`` here, and a model that stays so
  after the verification window was busy (serving), not stuck.
* Load: ``POST /api/generate {"model": M}`` (no prompt) loads it with the default keep_alive,
  or with ``keep_alive`` (seconds) when a pre-warm asks to keep it past its predicted use.
* Last use: Ollama never reports it; ``expires_at`` moves on every request (to now +
  keep_alive), so it is the usage fingerprint.  ``/v1/*`` ignores keep_alive: never used here.
"""

from __future__ import annotations

import itertools
import time
from datetime import datetime

from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import TenantHttpError, items, obj


def parse_time(text: object) -> float | None:
    """An RFC 3339 time as Ollama writes it (nanoseconds, offset) in epoch seconds."""
    if not isinstance(text, str) or not text:
        return None
    t = text.strip().replace("Z", "+00:00")
    date, _, rest = t.partition("T")
    # Python parses at most microseconds: cut the fraction to 6 digits, keep the offset.
    if "." in rest:
        clock, _, frac = rest.partition(".")
        digits = "".join(itertools.takewhile(str.isdigit, frac))
        offset = frac[len(digits) :]
        rest = f"{clock}.{digits[:6]}{offset}"
    try:
        return datetime.fromisoformat(f"{date}T{rest}").timestamp()
    except ValueError:
        return None


class OllamaAdapter(Adapter):
    kind = "ollama"

    def list(self) -> Seen:
        body = obj(self.client.get("/api/ps"), "GET /api/ps")
        now = time.time()
        models = []
        for m in items(body.get("models", []), "GET /api/ps models"):
            name = m.get("name") or m.get("model")
            if not isinstance(name, str):
                continue
            vram = m.get("size_vram")
            size = vram if isinstance(vram, int) and vram >= 0 else None
            expires = parse_time(m.get("expires_at"))
            past = expires is not None and expires <= now
            models.append(
                TenantModel(
                    name=name,
                    state="unloading" if past else "loaded",
                    size_bytes=size,
                    in_use=None,
                    detail="expired: freed when its requests end" if past else None,
                    fingerprint=str(m.get("expires_at")),
                )
            )
        return Seen(actual_kind="ollama", models=tuple(models))

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        body = {"model": model, "keep_alive": 0, "stream": False}
        reply = self.client.post("/api/generate", body, timeout_s=timeout_s)
        if isinstance(reply, dict) and reply.get("done_reason") not in (None, "unload"):
            raise TenantHttpError(
                f"unexpected answer to keep_alive 0: {reply.get('done_reason')!r}"
            )
        return "keep_alive 0 accepted"

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        # An empty prompt only loads the model (docs/api.md "Load a model"); keep_alive (a
        # number is seconds) keeps it past Ollama's default 5 minutes when a pre-warm asks.
        body: dict[str, object] = {"model": model, "stream": False}
        if keep_alive_s is not None:
            body["keep_alive"] = round(keep_alive_s)
        self.client.post("/api/generate", body, timeout_s=timeout_s)
