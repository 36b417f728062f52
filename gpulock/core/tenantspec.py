"""The ``tenants:`` section of the config, validated into ``TenantSpec`` records (pure).

::

    tenants:
      - {name: ollama, kind: ollama, url: "http://127.0.0.1:11434", pinned: [nomic-embed-text]}
      - {name: llama, kind: llama-server, url: "http://127.0.0.1:8080", min_idle: 5m}
      - name: tts
        kind: command
        command: [python, -m, llama_cpp.server, --model, /models/tiny.gguf, --port, "8090"]
        url: "http://127.0.0.1:8090"
        health: /v1/models
        need: 2GiB
        ready_timeout: 60s
        stop_timeout: 10s

Every mistake is a ``ConfigError`` naming the file, the line and the key (``tenants[1].kind``).
``gpulock.core.config`` imports this module only when the file has a ``tenants:`` section, so a
config without tenants never pays for it.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol

from gpulock.core.errors import ConfigError, known_hint
from gpulock.core.units import parse_duration, parse_size


class ConfigErrors(Protocol):
    """What this module needs of ``gpulock.core.config.Config``: errors that name the file,
    line and key.  A protocol, so that the config (which parses its ``tenants:`` list here)
    and this module do not import each other."""

    def error(self, key: str, problem: str, hint: str | None = None) -> ConfigError: ...


KINDS = ("ollama", "llama-server", "llama-swap", "vllm", "comfyui", "localai", "command")
KEYS = (
    "name", "kind", "url", "gpu", "api_key_env", "pinned", "min_idle",
    "command", "health", "need", "models", "ready_timeout", "stop_timeout",
)  # fmt: skip
COMMAND_ONLY = ("command", "health", "need", "models", "ready_timeout", "stop_timeout")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One configured tenant.  ``key`` is where it is written (``tenants[0]``)."""

    name: str
    kind: str
    url: str | None
    gpu: int
    key: str = ""
    api_key_env: str | None = None
    pinned: tuple[str, ...] = ()
    min_idle_s: float | None = None  # None: the watchdog's own min_idle
    # kind: command only
    command: tuple[str, ...] = ()
    health: str | None = None  # a path under url, or a full URL
    need_bytes: int | None = None
    models: tuple[str, ...] = ()
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0

    @property
    def health_url(self) -> str | None:
        if self.health is None:
            return None
        if "://" in self.health:
            return self.health
        return (self.url or "").rstrip("/") + "/" + self.health.lstrip("/")


def parse_tenants(cfg: ConfigErrors, raw: Any, default_gpu: int) -> tuple[TenantSpec, ...]:
    """The validated list; ``raw`` is the section as read (None: no tenants)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise cfg.error("tenants", "expected a list of tenants (- name: ..., kind: ...)")
    out: list[TenantSpec] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(raw):
        key = f"tenants[{index}]"
        spec = _tenant(cfg, key, item, default_gpu)
        if spec.name in seen:
            raise cfg.error(
                f"{key}.name",
                f"duplicate tenant name {spec.name!r} (first at {seen[spec.name]})",
                hint="every tenant needs its own name",
            )
        seen[spec.name] = key
        out.append(spec)
    return tuple(out)


def _tenant(cfg: ConfigErrors, key: str, item: Any, default_gpu: int) -> TenantSpec:
    if not isinstance(item, dict):
        raise cfg.error(key, "expected a mapping with name, kind and url")
    for k in item:
        if k not in KEYS:
            raise cfg.error(f"{key}.{k}", f"unknown tenant key {k!r}", hint=known_hint(k, KEYS))
    name = item.get("name")
    if not isinstance(name, str) or not name.strip() or "/" in name or name != name.strip():
        raise cfg.error(f"{key}.name", f"expected a tenant name without '/', got {name!r}")
    kind = item.get("kind")
    if kind not in KINDS:
        raise cfg.error(f"{key}.kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "command":
        for k in COMMAND_ONLY:
            if k in item:
                raise cfg.error(
                    f"{key}.{k}",
                    f"{k!r} is for kind: command only",
                    hint="gpulock starts and stops only kind: command servers",
                )
    url = _url(cfg, f"{key}.url", item.get("url"), required=True)
    gpu = item.get("gpu", default_gpu)
    if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
        raise cfg.error(f"{key}.gpu", f"expected a whole number >= 0, got {gpu!r}")
    api_key_env = _api_key_env(cfg, f"{key}.api_key_env", item.get("api_key_env"))
    pinned = _names(cfg, f"{key}.pinned", item.get("pinned", []))
    min_idle = item.get("min_idle")
    spec = TenantSpec(
        name=name,
        kind=kind,
        url=url,
        gpu=gpu,
        key=key,
        api_key_env=api_key_env,
        pinned=pinned,
        min_idle_s=None if min_idle is None else _duration(cfg, f"{key}.min_idle", min_idle),
    )
    if kind != "command":
        return spec
    argv = item.get("command")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str | int) for a in argv):
        raise cfg.error(
            f"{key}.command",
            "expected the server's argv as a list, e.g. [llama-server, -m, model.gguf]",
            hint="it is run directly, never through a shell",
        )
    health = item.get("health")
    if health is not None and (not isinstance(health, str) or not health.strip()):
        raise cfg.error(f"{key}.health", f"expected a path like /health or a URL, got {health!r}")
    if isinstance(health, str) and "://" in health:
        _url(cfg, f"{key}.health", health, required=True)
    need = item.get("need")
    if need is None:
        raise cfg.error(
            f"{key}.need", "a command tenant needs 'need': the VRAM it uses, like 6GiB",
            hint="gpulock holds a ticket with this need while the server runs",
        )  # fmt: skip
    try:
        need_bytes = parse_size(need)
    except (ValueError, TypeError) as exc:
        raise cfg.error(f"{key}.need", str(exc)) from None
    models = _names(cfg, f"{key}.models", item.get("models", [name]))
    return TenantSpec(
        name=spec.name,
        kind=spec.kind,
        url=spec.url,
        gpu=spec.gpu,
        key=key,
        api_key_env=spec.api_key_env,
        pinned=spec.pinned,
        min_idle_s=spec.min_idle_s,
        command=tuple(str(a) for a in argv),
        health=health or "/health",
        need_bytes=need_bytes,
        models=models or (name,),
        ready_timeout_s=_duration(cfg, f"{key}.ready_timeout", item.get("ready_timeout", "120s")),
        stop_timeout_s=_duration(cfg, f"{key}.stop_timeout", item.get("stop_timeout", "10s")),
    )


def _url(cfg: ConfigErrors, key: str, value: Any, *, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise cfg.error(key, f"expected a base URL like http://127.0.0.1:11434, got {value!r}")
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise cfg.error(
            key,
            f"expected an http:// or https:// URL with a host, got {value!r}",
            hint="a tenant is a server: http://127.0.0.1:PORT",
        )
    return value.rstrip("/")


def _api_key_env(cfg: ConfigErrors, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise cfg.error(key, "expected the NAME of an environment variable")
    if not _env_name(value):
        # Never echo the value: it may be the key itself, and errors end up in cron mail.
        raise cfg.error(
            key,
            "expected an environment variable name like OLLAMA_API_KEY, got a value that looks "
            f"like a key ({len(value)} characters, not shown)",
            hint="this is the variable's name, not the key itself",
        )
    return value


def _env_name(text: str) -> bool:
    """A plausible variable name (``OLLAMA_KEY``), not a pasted key (``sk-...``, hex...)."""
    if text.lower().startswith(("sk-", "sk_")) or len(text) > 64:
        return False
    if not (text.isascii() and text.replace("_", "").isalnum() and not text[0].isdigit()):
        return False
    # Variable names are words; keys are long runs of mixed case and digits.
    digits = sum(c.isdigit() for c in text)
    return not (len(text) >= 24 and digits >= 4 and not text.isupper())


def _names(cfg: ConfigErrors, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise cfg.error(key, "expected a list of model names")
    return tuple(value)


def _duration(cfg: ConfigErrors, key: str, value: Any) -> float:
    try:
        return parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise cfg.error(key, str(exc)) from None
