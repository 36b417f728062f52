"""The ``cluster:`` section of the gpulock config, validated (no Redis is touched here).

::

    cluster:
      redis: redis://10.0.0.5:6379/0    # rediss://... (TLS) or unix:///run/redis/redis.sock
      password_env: GPULOCK_REDIS_PASSWORD   # the NAME of the variable holding the password
      prefix: "gpulock:"                 # several clusters may share one Redis
      host: box-3090                     # this host's name (default: the hostname;
                                         # $GPULOCK_HOST wins)
      gateway: http://10.0.0.7:11435     # where peers reach this host's `gpulock serve`
      api_key_env: GPULOCK_PEER_KEY      # the key this host presents to peers' gateways
      heartbeat: 2s                      # how often `gpulock serve` publishes this host
      remote_penalty: 1s                 # added to a peer's estimate (network, risk)
      peer_timeout: 5s                   # no response headers from a peer in this long: next
      tls_ca: /etc/gpulock/redis-ca.pem  # rediss:// only: the CA that signed Redis's certificate
                                         # (default: the system's CAs); tls_cert and tls_key
                                         # (together): a client certificate, when Redis asks

Over ``rediss://`` the server's certificate is always verified (against ``tls_ca``, else the
system's CAs) and must name the URL's host; ``ssl_*`` parameters in the URL are refused (they
would override these keys, or switch verification off).  Paths are relative to the config file.
A URL that carries a password is refused, and the error never repeats the URL: passwords live
in the environment (``password_env``), never in the config file.  Errors name the file, the
line and the key, like every gpulock config error.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from gpulock.core import apikeys
from gpulock.core.config import Config
from gpulock.core.units import parse_duration

SECTION: Final = "cluster"
ENV_HOST: Final = "GPULOCK_HOST"
KEYS: Final = (
    "redis",
    "password_env",
    "prefix",
    "host",
    "gateway",
    "api_key_env",
    "heartbeat",
    "remote_penalty",
    "peer_timeout",
    "tls_ca",
    "tls_cert",
    "tls_key",
)
SCHEMES: Final = ("redis", "rediss", "unix")
DEFAULT_PREFIX: Final = "gpulock:"
DEFAULT_HEARTBEAT_S: Final = 2.0
DEFAULT_REMOTE_PENALTY_S: Final = 1.0
DEFAULT_PEER_TIMEOUT_S: Final = 5.0
# Every Redis call: an unreachable or frozen Redis once hung every LiteLLM request; ours waits
# at most this long, then the host works alone until the back-off lets it try again.
REDIS_TIMEOUT_S: Final = 0.5
GONE_AFTER_HEARTBEATS: Final = 3  # a host silent this many heartbeats is gone


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    redis_url: str
    host: str
    password_env: str | None = None
    prefix: str = DEFAULT_PREFIX
    gateway: str | None = None
    api_key_env: str | None = None
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    remote_penalty_s: float = DEFAULT_REMOTE_PENALTY_S
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    tls_ca: str | None = None  # rediss:// only: a PEM file of the CA(s) to verify Redis with
    tls_cert: str | None = None  # a client certificate (PEM), with tls_key
    tls_key: str | None = None

    @property
    def tls(self) -> bool:
        return self.redis_url.startswith("rediss://")

    @property
    def ttl_s(self) -> float:
        """How long a host's report lives in Redis without a new heartbeat."""
        return GONE_AFTER_HEARTBEATS * self.heartbeat_s

    def password(self, environ: Mapping[str, str] | None = None) -> str | None:
        if self.password_env is None:
            return None
        return (os.environ if environ is None else environ).get(self.password_env) or None

    def redacted_url(self) -> str:
        """The URL for messages: it never carries a password (load refuses one), but say where."""
        return self.redis_url


def configured(cfg: Config) -> bool:
    """Is there a ``cluster:`` section at all (without validating it)?"""
    return cfg.section(SECTION) is not None


def load(cfg: Config, environ: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The validated section; None when the config has none (a host on its own)."""
    env = os.environ if environ is None else environ
    raw = cfg.settings_of(SECTION, KEYS)
    if raw is None:
        return None
    if raw.get("redis") is None:
        raise cfg.error(
            f"{SECTION}.redis",
            "missing: the Redis the hosts share",
            hint="redis: redis://HOST:6379/0 (or rediss://... or unix:///path)",
        )
    url = _redis_url(cfg, raw["redis"])
    host = env.get(ENV_HOST) or raw.get("host") or socket.gethostname()
    if not isinstance(host, str) or not host.strip() or not host.isprintable() or len(host) > 64:
        raise cfg.error(f"{SECTION}.host", "expected a host name of at most 64 characters")
    prefix = raw.get("prefix", DEFAULT_PREFIX)
    if not isinstance(prefix, str) or not prefix.isprintable() or " " in prefix:
        raise cfg.error(
            f"{SECTION}.prefix", f"expected a key prefix like 'gpulock:', got {prefix!r}"
        )
    tls = {k: _tls_file(cfg, raw, k) for k in ("tls_ca", "tls_cert", "tls_key")}
    given = [k for k, v in tls.items() if v is not None]
    if given and not url.startswith("rediss://"):
        raise cfg.error(
            f"{SECTION}.{given[0]}",
            "TLS settings need a rediss:// URL in cluster.redis",
            hint="redis: rediss://HOST:6380/0",
        )
    if (tls["tls_cert"] is None) != (tls["tls_key"] is None):
        missing = "tls_key" if tls["tls_key"] is None else "tls_cert"
        raise cfg.error(
            f"{SECTION}.{missing}",
            "missing: a client certificate needs both tls_cert and tls_key",
        )
    return ClusterConfig(
        redis_url=url,
        host=host.strip(),
        password_env=_env_name(cfg, raw, "password_env", "the password"),
        prefix=prefix,
        gateway=_gateway(cfg, raw.get("gateway")),
        api_key_env=_env_name(cfg, raw, "api_key_env", "the key for peers' gateways"),
        heartbeat_s=_duration(cfg, raw, "heartbeat", DEFAULT_HEARTBEAT_S, least=0.1),
        remote_penalty_s=_duration(cfg, raw, "remote_penalty", DEFAULT_REMOTE_PENALTY_S, least=0),
        peer_timeout_s=_duration(cfg, raw, "peer_timeout", DEFAULT_PEER_TIMEOUT_S, least=0.1),
        **tls,
    )


def _redis_url(cfg: Config, value: Any) -> str:
    key = f"{SECTION}.redis"
    if not isinstance(value, str):
        raise cfg.error(key, f"expected a URL like redis://HOST:6379/0, got {type(value).__name__}")
    try:
        parts = urlsplit(value.strip())
        has_password = bool(parts.password) or "password" in parse_qs(parts.query)
    except ValueError:
        raise cfg.error(
            key, "not a URL (redis://HOST:PORT/DB, rediss://..., unix:///path)"
        ) from None
    if has_password:
        # Never echo the URL: the password in it is the very thing that must not be shown.
        raise cfg.error(
            key,
            "the URL carries a password; refusing it (passwords never go in the config file)",
            hint=f"put the password in a variable and name it: {SECTION}.password_env: "
            "GPULOCK_REDIS_PASSWORD",
        )
    tls_params = sorted({k for k in parse_qs(parts.query) if k.lower().startswith("ssl_")})
    if tls_params:
        # redis-py would take them over the keys below, and ssl_cert_reqs=none switches
        # certificate verification off: one place names the CA, and verification stays on.
        raise cfg.error(
            key,
            "TLS options in the URL are not taken: " + ", ".join(tls_params),
            hint=f"name the CA with {SECTION}.tls_ca (and a client certificate with "
            f"{SECTION}.tls_cert and {SECTION}.tls_key); verification always stays on",
        )
    if parts.scheme not in SCHEMES:
        raise cfg.error(
            key,
            f"unknown scheme {parts.scheme!r}",
            hint="known schemes: " + ", ".join(f"{s}://" for s in SCHEMES),
        )
    if parts.scheme == "unix" and not parts.path:
        raise cfg.error(key, "a unix:// URL needs the socket's path: unix:///run/redis.sock")
    if parts.scheme != "unix" and not parts.hostname:
        raise cfg.error(key, "the URL names no host: redis://HOST:6379/0")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise cfg.error(key, "the URL's port is not a number from 1 to 65535") from None
    return value.strip()


def _env_name(cfg: Config, raw: Mapping[str, Any], name: str, what: str) -> str | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not apikeys.is_env_name(value):
        # Never echo it: it may be the secret itself, pasted where the variable's name belongs.
        raise cfg.error(
            f"{SECTION}.{name}",
            f"expected the NAME of an environment variable holding {what}",
            hint="the secret goes in that variable, never in the config file",
        )
    return value


def _tls_file(cfg: Config, raw: Mapping[str, Any], name: str) -> str | None:
    """A PEM file's path (``~`` expanded, relative to the config file), readable now."""
    value = raw.get(name)
    if value is None:
        return None
    key = f"{SECTION}.{name}"
    if not isinstance(value, str) or not value.strip():
        raise cfg.error(key, "expected the path of a PEM file")
    path = os.path.expanduser(value.strip())
    if not os.path.isabs(path) and cfg.path is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(cfg.path)), path)
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise cfg.error(key, f"cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in head:
        # Never echo the content: a key pasted in the wrong place is still a secret.
        raise cfg.error(key, f"{path} is not a PEM file (no '-----BEGIN' line)")
    return path


def _gateway(cfg: Config, value: Any) -> str | None:
    if value is None:
        return None
    key = f"{SECTION}.gateway"
    if not isinstance(value, str):
        raise cfg.error(key, "expected a URL like http://10.0.0.7:11435")
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise cfg.error(key, f"expected a URL like http://10.0.0.7:11435, got {value!r}")
    if parts.password or parts.username:
        raise cfg.error(key, "the URL carries credentials; use cluster.api_key_env")
    return value.strip().rstrip("/")


def _duration(
    cfg: Config, raw: Mapping[str, Any], name: str, default: float, least: float
) -> float:
    value = raw.get(name)
    if value is None:
        return default
    key = f"{SECTION}.{name}"
    try:
        s = parse_duration(value, key=key)
    except ValueError as e:
        raise cfg.error(key, str(e)) from None
    if s < least:
        raise cfg.error(key, f"expected at least {least:g}s, got {value!r}")
    return s
