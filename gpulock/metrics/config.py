"""The ``metrics:`` section of the gpulock config, validated.

::

    metrics:
      listen: 127.0.0.1:9464   # gpulock governor serves /metrics here (HOST:PORT; ":9464" or
                               # "9464" alone bind 127.0.0.1); absent: no listener
      api_keys_env: GPULOCK_METRICS_KEYS
                               # the NAME of a variable holding bearer key(s), comma- or
                               # whitespace-separated: then every scrape needs
                               # "Authorization: Bearer KEY"; required unless listen is loopback
      textfile: /var/lib/node_exporter/textfile_collector/gpulock.prom
                               # the governor rewrites it after each pass (atomically)

Errors name the config file, the line and the key, like every gpulock config error.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulock.core import apikeys
from gpulock.core.config import Config
from gpulock.core.errors import GpulockError
from gpulock.core.state import expand_path

KEYS = ("listen", "textfile", "api_keys_env")
DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    listen: Listen | None = None
    textfile: Path | None = None
    api_keys_env: str | None = None


class MetricsListenError(GpulockError):
    """A listener that would be open to the network without keys (or keys that are not set)."""

    exit_code = 2


def parse_listen(text: str) -> Listen:
    """``HOST:PORT``, ``[::1]:PORT``, ``:PORT`` or ``PORT`` (those two bind 127.0.0.1)."""
    raw = str(text).strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        host, port_text = "", raw
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"expected an IPv6 address in [...], got {text!r}") from None
    elif ":" in host:
        raise ValueError(f"write an IPv6 address in brackets, like [::1]:9464; got {text!r}")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"expected HOST:PORT with a port from 0 to 65535, got {text!r}")
    return Listen(host or DEFAULT_HOST, int(port_text))


def load(cfg: Config) -> MetricsConfig:
    """The section from a loaded Config; ConfigError names file:line:key."""
    raw: Any = cfg.settings_of("metrics", KEYS) or {}
    listen = None
    if raw.get("listen") is not None:
        try:
            listen = parse_listen(str(raw["listen"]))
        except ValueError as e:
            raise cfg.error("metrics.listen", str(e)) from None
    textfile = None
    if raw.get("textfile") is not None:
        value = raw["textfile"]
        if not isinstance(value, str) or not value.strip():
            raise cfg.error("metrics.textfile", f"expected a file path, got {value!r}")
        try:
            textfile = check_textfile(expand_path(value), cfg.path)
        except ValueError as e:
            raise cfg.error("metrics.textfile", str(e)) from None
    env = raw.get("api_keys_env")
    if env is not None and (not isinstance(env, str) or not apikeys.is_env_name(env)):
        # Never echo it: it may be a key pasted where the variable's name belongs.
        raise cfg.error(
            "metrics.api_keys_env",
            "expected the NAME of an environment variable, like GPULOCK_METRICS_KEYS",
            hint="the keys go in that variable, never in the config file",
        )
    return MetricsConfig(listen, textfile, env)


def listen_keys(
    listen: Listen, api_keys_env: str | None, environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The bearer keys the listener must demand; () = open, allowed only on loopback.

    MetricsListenError (exit 2) for a non-loopback listener without keys, and for a
    ``metrics.api_keys_env`` that names an empty or unset variable (a typo must not open
    the listener).  Messages name the variable, never a key.
    """
    keys = apikeys.read_keys(api_keys_env, environ)
    if api_keys_env is not None and not keys:
        raise MetricsListenError(
            f"metrics.api_keys_env names {api_keys_env}, which holds no key",
            hint=f"export {api_keys_env}=... (one or more keys, comma-separated)"
            + ("" if not apikeys.is_loopback(listen.host) else " or remove metrics.api_keys_env"),
        )
    if not keys and not apikeys.is_loopback(listen.host):
        raise MetricsListenError(
            f"refusing to serve metrics on {listen} without API keys",
            hint="set metrics.api_keys_env to the NAME of a variable holding the keys, "
            "or listen on 127.0.0.1",
        )
    return keys


def check_textfile(path: Path, config_path: Path | None = None) -> Path:
    """An absolute ``.prom`` path (node_exporter reads no other); relative to the config file."""
    if path.suffix != ".prom":
        raise ValueError(f"node_exporter's textfile collector reads *.prom files only: {path}")
    if not path.is_absolute():
        path = (config_path.parent if config_path is not None else Path.cwd()) / path
    return path
