"""The ``serve:`` section of the gpulock config, validated.

::

    serve:
      listen: 127.0.0.1:11435   # HOST:PORT; anything but loopback needs api_keys_env
      api_keys_env: GPULOCK_SERVE_KEYS   # the NAME of a variable holding the key(s),
                                         # comma- or whitespace-separated
      max_queue: 256            # requests waiting for a model at once; past it, 429
      max_body: 8MiB            # largest request body; past it, 413
      max_header: 16KiB         # largest request line + headers; past it, 431
      read_timeout: 30s         # a request's headers, and then its body, must arrive within
                                # this; past it, 408 and the connection closed

Errors name the config file, the line and the key, like every gpulock config error.  The keys
themselves are read from the environment when the server starts and never appear in an error,
a log line or an event.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpulock.core import apikeys
from gpulock.core.config import Config
from gpulock.core.errors import GpulockError
from gpulock.router import routevalues as rv

DEFAULT_LISTEN = "127.0.0.1:11435"
KEYS = ("listen", "api_keys_env", "max_queue", "max_body", "max_header", "read_timeout")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 11435
    api_keys_env: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 16 << 10
    read_timeout_s: float = 30.0


class ListenError(GpulockError):
    """A listen address that cannot be used as asked (bad form, or open without keys)."""

    exit_code = 2


def parse_listen(text: str, *, key: str | None = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; ``:PORT`` or a bare ``PORT`` means loopback)
    -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep and port.isdigit():
        host, sep = "127.0.0.1", ":"  # a bare port, as Ollama's OLLAMA_HOST takes one
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ListenError(
            (f"{key}: " if key else "") + f"expected HOST:PORT like 127.0.0.1:11435, got {text!r}",
            hint="the port is a number from 1 to 65535 (a bare PORT listens on 127.0.0.1)",
        )
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def parse_port(text: str) -> int:
    """``--port``'s value: a number from 1 to 65535."""
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ListenError(
            f"--port: expected a number from 1 to 65535, got {text!r}",
            hint="--port 11435 (on serve.listen's host, else 127.0.0.1), or --listen HOST:PORT",
        )
    return int(text)


is_loopback = apikeys.is_loopback  # shared with gpulock's metrics listener


def load(cfg: Config) -> ServeConfig:
    raw = cfg.settings_of("serve", KEYS) or {}
    host, port = parse_listen(DEFAULT_LISTEN)
    if raw.get("listen") is not None:
        try:
            host, port = parse_listen(str(raw["listen"]), key=None)
        except ListenError as e:
            raise cfg.error("serve.listen", e.message, hint=e.hint) from None
    env = raw.get("api_keys_env")
    if env is not None and (not isinstance(env, str) or not _env_name(env)):
        # Never echo it: it may be a key pasted where the variable's name belongs.
        raise cfg.error(
            "serve.api_keys_env",
            "expected the NAME of an environment variable, like GPULOCK_SERVE_KEYS",
            hint="the keys go in that variable, never in the config file",
        )
    return ServeConfig(
        host=host,
        port=port,
        api_keys_env=env,
        max_queue=rv.whole(cfg, "serve.max_queue", raw.get("max_queue", 256), low=1),
        max_body_bytes=rv.size(cfg, "serve.max_body", raw.get("max_body", "8MiB")),
        max_header_bytes=rv.size(cfg, "serve.max_header", raw.get("max_header", "16KiB")),
        read_timeout_s=rv.duration(cfg, "serve.read_timeout", raw.get("read_timeout", "30s")),
    )


def read_keys(sc: ServeConfig) -> tuple[str, ...]:
    """The API keys from ``api_keys_env`` (comma- or whitespace-separated); () when unset."""
    return apikeys.read_keys(sc.api_keys_env)


_env_name = apikeys.is_env_name
