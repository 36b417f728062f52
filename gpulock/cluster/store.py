"""The one door to Redis: short timeouts, no blind retries, a back-off after a failure.

Every call carries a timeout of ``REDIS_TIMEOUT_S`` (0.5 s) for the connect and for the answer,
and the client's own retries are switched off: a Redis that is down, partitioned or frozen
(SIGSTOP: connections accepted, nothing answered) costs a caller at most that long once, then
``Unavailable`` at once until the back-off (1 s, doubling to 15 s) lets one call try again.
The ``redis`` client (the ``cluster`` extra) is imported here, on the first call, and nowhere
else: ``import gpulock`` and ``gpulock run`` never load it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from gpulock.cluster import keys
from gpulock.cluster.config import REDIS_TIMEOUT_S, ClusterConfig
from gpulock.core import safejson
from gpulock.core.errors import GpulockError

T = TypeVar("T")
BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 15.0
REPORT_MAX: Final = 1 << 20  # a host's report is a few KiB; a bigger value is not ours


class Unavailable(GpulockError):
    """Redis cannot be used now (down, frozen, wrong password); the host works alone."""

    exit_code = 1


def _client_module() -> Any:
    try:
        import redis
    except ImportError:
        from gpulock.core.extras import install_hint

        raise GpulockError(
            "the cluster: section needs the redis client", hint=install_hint("cluster")
        ) from None
    return redis


class Store:
    """A host's connection to the cluster's Redis, and what it reads and writes there."""

    def __init__(
        self,
        cc: ClusterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        environ: Mapping[str, str] | None = None,
        timeout_s: float = REDIS_TIMEOUT_S,
    ) -> None:
        self.cc = cc
        self.clock = clock
        self.environ = environ
        self.timeout_s = timeout_s
        self._redis: Any = None
        self.problem: str | None = None  # why the last call failed; None: the last one worked
        self._retry_at = 0.0
        self._backoff_s = BACKOFF_FIRST_S

    @property
    def up(self) -> bool:
        return self.problem is None

    def _client(self) -> Any:
        if self._redis is None:
            redis = _client_module()
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            tls: dict[str, Any] = {}
            if self.cc.tls:  # verified always: against tls_ca, else the system's CAs
                tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
                if self.cc.tls_ca:
                    tls["ssl_ca_certs"] = self.cc.tls_ca
                if self.cc.tls_cert:
                    tls.update(ssl_certfile=self.cc.tls_cert, ssl_keyfile=self.cc.tls_key)
            self._redis = redis.Redis.from_url(
                self.cc.redis_url,
                **tls,
                password=self.cc.password(self.environ),
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),  # no blind retries: one try, then the back-off
                retry_on_timeout=False,
                health_check_interval=0,
                decode_responses=True,
            )
        return self._redis

    def call(self, what: Callable[[Any], T]) -> T:
        """Run ``what(client)``; ``Unavailable`` when Redis fails or is backing off."""
        now = self.clock()
        if self.problem is not None and now < self._retry_at:
            raise Unavailable(f"redis unavailable: {self.problem}", hint=self._hint())
        redis = _client_module()
        try:
            out = what(self._client())
        except redis.exceptions.AuthenticationError:
            self._failed(now, "wrong password" + self._password_note())
        except redis.exceptions.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                self._failed(now, "wrong password" + self._password_note())
            raise
        except (redis.exceptions.TimeoutError, TimeoutError):
            self._failed(now, f"no answer within {self.timeout_s:g}s")
        except (redis.exceptions.ConnectionError, OSError) as e:
            self._failed(now, _tls_problem(e, self.cc) or _short(e))
        else:
            self.problem = None
            self._backoff_s = BACKOFF_FIRST_S
            return out
        raise Unavailable(f"redis unavailable: {self.problem}", hint=self._hint())

    def _failed(self, now: float, problem: str) -> None:
        self.problem = f"{problem} ({self.cc.redis_url})"
        self._retry_at = now + self._backoff_s
        self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)
        self.close()  # a fresh connection next time: the old one may be wedged

    def _password_note(self) -> str:
        env = self.cc.password_env
        return f" (from ${env})" if env else " (cluster.password_env is not set)"

    def _hint(self) -> str:
        return "routing stays on this host until Redis answers again; check cluster.redis"

    def close(self) -> None:
        if self._redis is not None:
            try:
                self._redis.close()
            except Exception:
                pass
            self._redis = None

    # --- what a host shares ------------------------------------------------------------------

    def publish(self, report: Mapping[str, Any], *, now_wall: float | None = None) -> None:
        """Write this host's report; it expires after three heartbeats without another."""
        at = time.time() if now_wall is None else now_wall
        data = json.dumps(report, separators=(",", ":"))
        ttl_ms = max(1, int(self.cc.ttl_s * 1000))
        p, name = self.cc.prefix, self.cc.host

        def write(r: Any) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.set(keys.host(p, name), data, px=ttl_ms)
            pipe.zadd(keys.hosts(p), {name: at})
            pipe.execute()

        self.call(write)

    def withdraw(self) -> None:
        """Leave at once (a clean shutdown): peers stop routing here before the TTL."""
        p, name = self.cc.prefix, self.cc.host

        def delete(r: Any) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.delete(keys.host(p, name))
            pipe.zrem(keys.hosts(p), name)
            pipe.execute()

        self.call(delete)

    def hosts(self) -> list[dict[str, Any]]:
        """The live hosts' reports (this host's included), by name."""
        p = self.cc.prefix

        def read(r: Any) -> tuple[list[str], list[str | None]]:
            names = list(r.zrange(keys.hosts(p), 0, -1))
            values = list(r.mget([keys.host(p, n) for n in names])) if names else []
            gone = [n for n, v in zip(names, values, strict=True) if v is None]
            if gone:
                r.zrem(keys.hosts(p), *gone)  # expired: they stopped publishing
            return names, values

        names, values = self.call(read)
        out = []
        for name, value in zip(names, values, strict=True):
            report = _report(value)
            if report is not None and report.get("host") == name:
                out.append(report)
        return sorted(out, key=lambda r: str(r["host"]))


def _report(value: str | None) -> dict[str, Any] | None:
    if value is None or len(value) > REPORT_MAX:
        return None
    try:
        obj = safejson.loads(value.encode())
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _tls_problem(e: BaseException, cc: ClusterConfig) -> str | None:
    """A failed TLS handshake, said plainly (the reason, and which CA it was checked against);
    None when ``e`` is not one."""
    if not cc.tls:
        return None
    import ssl

    text = str(e)
    cause = e.__cause__ or e.__context__
    verify = isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text
    if verify:
        reason = getattr(cause, "verify_message", None) or _after(text, "verify failed:")
        against = f"the CA in {cc.tls_ca}"
        if not cc.tls_ca:
            against = "the system's CAs; name the server's CA with cluster.tls_ca"
        return f"TLS: certificate verify failed ({reason}; checked against {against})"
    if isinstance(cause, ssl.SSLError) or "SSL" in text or "ssl" in text:
        ask = "" if cc.tls_cert else "; if Redis asks for a client certificate: cluster.tls_cert"
        return "TLS: " + _short(e) + ask
    return None


def _after(text: str, marker: str) -> str:
    i = text.find(marker)
    rest = text[i + len(marker) :] if i >= 0 else text
    return rest.split("(_ssl.c")[0].strip().rstrip(".") or "unknown reason"


def _short(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]
