"""The cluster over TLS (``rediss://``), for real: a ``redis-server`` that speaks only TLS, with a
certificate for 127.0.0.1 signed by a throwaway CA made here with the ``openssl`` command.

A host that names the CA (``cluster.tls_ca``) publishes and reads; a host that names another CA
is refused by the handshake and says so (``redis unavailable: TLS: certificate verify failed``),
at once, never a hang and never a traceback; a URL with a password is still refused unechoed.
Skipped, with the reason, where ``redis-server`` was built without TLS or ``openssl`` is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from procs import wait_until
from redis_server import HANG_BOUND_S, RedisServer, need_redis
from serve_server import GatewayProc

from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.heartbeat import Heartbeat
from gpulock.cluster.report import HostReport
from gpulock.cluster.store import Store, Unavailable
from gpulock.core.config import load_config
from gpulock.core.errors import ConfigError
from gpulock.core.settings import load as load_settings

NO_TLS = "redis-server has no TLS support here (it did not start with --tls-port)"


def openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA that signed the server's certificate
    other_ca: Path  # a CA that did not
    cert: Path
    key: Path


def make_certs(folder: Path) -> Certs:
    """A throwaway CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (Debian's 'openssl' package)")
    folder.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for name in ("ca", "other-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem",
                "-days", "2", "-subj", f"/CN=gpulock test {name}", cwd=folder)  # fmt: skip

    def signed(name: str, subject: str, extension: str) -> None:
        """``NAME.key`` and ``NAME.pem``: a certificate for ``subject`` signed by ``ca``."""
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
                cwd=folder)  # fmt: skip
        (folder / f"{name}.cnf").write_text(extension + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.cnf",
                cwd=folder)  # fmt: skip

    signed("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1")
    # A client certificate, signed by the same CA, for a Redis that asks for one.
    signed("client", "/CN=host-a", "extendedKeyUsage=clientAuth")
    return Certs(folder / "ca.pem", folder / "other-ca.pem", folder / "server.pem",
                 folder / "server.key")  # fmt: skip


@dataclass
class TlsRedis(RedisServer):
    """``RedisServer`` on a TLS port only (no plain port), clients not asked for certificates."""

    certs: Certs | None = None
    auth_clients: str = "no"  # "yes": a client must present a certificate signed by the CA

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def argv(self, exe: str) -> list[str]:
        assert self.certs is not None
        argv = [exe, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--tls-cert-file", str(self.certs.cert), "--tls-key-file", str(self.certs.key)]
        argv += ["--tls-ca-cert-file", str(self.certs.ca), "--tls-auth-clients", self.auth_clients]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.folder)]
        return argv

    def exited(self, log: str) -> NoReturn:
        if "tls" in log.lower() or "ssl" in log.lower():
            pytest.skip(f"{NO_TLS}: {log.strip().splitlines()[-1]}")
        super().exited(log)

    def _answers(self) -> bool:
        assert self.certs is not None
        ctx = ssl.create_default_context(cafile=str(self.certs.ca))
        if self.auth_clients == "yes":
            folder = self.certs.ca.parent
            ctx.load_cert_chain(folder / "client.pem", folder / "client.key")
        try:
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw,
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
            ):
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    need_redis()
    root = tmp_path_factory.mktemp("tls")
    server = TlsRedis(root / "redis", certs=make_certs(root / "certs")).start()
    try:
        yield server
    finally:
        server.stop()


def host_env(folder: Path, body: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpulock.yaml").write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(GPULOCK_CONFIG=str(folder / "gpulock.yaml"), GPULOCK_STATE_DIR=str(folder / "s"))
    return env


def cluster_cli(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpulock", "cluster", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def publish(env: dict[str, str], name: str) -> Heartbeat:
    """One heartbeat of host ``name`` (a real publisher: serve's), through ``env``'s config."""
    from gpulock.cluster import config as cluster_config

    settings = load_settings(load_config(env["GPULOCK_CONFIG"]), env["GPULOCK_STATE_DIR"])
    cc = cluster_config.load(settings.config)
    assert cc is not None and cc.host == name
    beat = Heartbeat(settings, cc, lambda now: HostReport(name, None, now, 60.0))
    beat.tick()
    return beat


def test_a_host_that_names_the_ca_publishes_and_reads_over_tls(
    tls_redis: TlsRedis, tmp_path: Path
) -> None:
    assert tls_redis.certs is not None
    # A relative tls_ca is relative to the config file.
    (tmp_path / "a").mkdir()
    shutil.copy(tls_redis.certs.ca, tmp_path / "a" / "ca.pem")
    env = host_env(
        tmp_path / "a", f"cluster: {{redis: '{tls_redis.url}', host: a, tls_ca: ca.pem}}\n"
    )
    publish(env, "a")
    out = cluster_cli(env)
    assert out.returncode == 0, out.stdout + out.stderr
    obj = json.loads(out.stdout)
    assert obj["redis"] == "ok" and [h["name"] for h in obj["hosts"]] == ["a"], obj
    assert obj["spend"]["total_usd"] == 0


def test_a_wrong_ca_is_a_clear_degraded_state_not_a_hang(
    tls_redis: TlsRedis, tmp_path: Path
) -> None:
    assert tls_redis.certs is not None
    body = f"cluster: {{redis: '{tls_redis.url}', host: w, tls_ca: '{tls_redis.certs.other_ca}'}}\n"
    env = host_env(tmp_path / "w", body)
    started = time.monotonic()
    out = cluster_cli(env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    err = json.loads(out.stdout or out.stderr)
    text = json.dumps(err)
    assert "redis unavailable: TLS: certificate verify failed" in text, text
    assert str(tls_redis.certs.other_ca) in text, text  # which CA it was checked against
    # The publisher sees the same, and marks the host degraded (local only), at once.
    beat = publish(env, "w")
    assert beat.store.problem is not None
    assert beat.store.problem.startswith("TLS: certificate verify failed"), beat.store.problem
    assert time.monotonic() - started < HANG_BOUND_S  # a handshake refused, not a hang
    # In process: Unavailable, with the reason.
    cc = ClusterConfig(redis_url=tls_redis.url, host="w", tls_ca=str(tls_redis.certs.other_ca))
    with pytest.raises(Unavailable, match="certificate verify failed"):
        Store(cc).hosts()
    # No CA named: the system's CAs do not know this one either; verification stays on.
    with pytest.raises(Unavailable, match=r"certificate verify failed.*system's CAs"):
        Store(ClusterConfig(redis_url=tls_redis.url, host="w")).hosts()


def serve_host(env: dict[str, str], folder: Path) -> GatewayProc:
    keep = {k: env[k] for k in ("GPULOCK_CONFIG", "GPULOCK_STATE_DIR")}
    return GatewayProc(log=folder / "serve.log", env=keep).start()


def test_serve_hosts_over_tls_publish_and_one_with_a_wrong_ca_says_why(
    tls_redis: TlsRedis, tmp_path: Path
) -> None:
    assert tls_redis.certs is not None
    url = tls_redis.url
    good = host_env(tmp_path / "g", f"simulate: 24GiB\ncluster: {{redis: '{url}', host: g, "
                    f"heartbeat: 500ms, tls_ca: '{tls_redis.certs.ca}'}}\n")  # fmt: skip
    bad = host_env(tmp_path / "b", f"simulate: 24GiB\ncluster: {{redis: '{url}', host: b, "
                   f"heartbeat: 500ms, tls_ca: '{tls_redis.certs.other_ca}'}}\n")  # fmt: skip
    g = serve_host(good, tmp_path / "g")
    b = serve_host(bad, tmp_path / "b")
    try:

        def seen() -> list[str]:
            out = cluster_cli(good)
            return (
                [h["name"] for h in json.loads(out.stdout)["hosts"]] if out.returncode == 0 else []
            )

        wait_until(lambda: seen() == ["g"], 30.0, "serve g to publish over TLS")
        assert g.request("GET", "/health").json()["cluster"]["redis"] == "ok"
        health = wait_until(
            lambda: (c := b.request("GET", "/health").json()["cluster"])["problem"] and c,
            30.0,
            "serve b to say why Redis cannot be used",
        )
        assert health["redis"] == "down", health
        assert "TLS: certificate verify failed" in health["problem"], health
        events = (tmp_path / "b" / "s" / "events.jsonl").read_text()
        assert '"cluster-degraded"' in events and "certificate verify failed" in events
        assert seen() == ["g"]  # b never got in
        assert b.request("GET", "/health").status == 200  # and serves alone meanwhile
    finally:
        g.stop()
        b.stop()


IN_URL = "s3cr3t-tls-pw"  # made up: the password a careless URL carries


def test_a_rediss_url_with_a_password_is_refused_unechoed(
    tls_redis: TlsRedis, tmp_path: Path
) -> None:
    url = tls_redis.url.replace("rediss://", f"rediss://:{IN_URL}@")
    env = host_env(tmp_path / "p", f"cluster: {{redis: '{url}', host: p}}\n")
    out = cluster_cli(env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert IN_URL not in out.stdout + out.stderr
    err: dict[str, Any] = json.loads(out.stdout or out.stderr)
    assert err["error"]["type"] == "ConfigError" and "carries a password" in json.dumps(err), err


def test_tls_keys_are_checked_when_the_config_loads(tmp_path: Path) -> None:
    from gpulock.cluster import config as cluster_config

    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (tmp_path / "notpem.txt").write_text("hello\n")

    def problem(body: str) -> str:
        path = tmp_path / "gpulock.yaml"
        path.write_text(body)
        with pytest.raises(ConfigError) as e:
            cluster_config.load(load_config(str(path)))
        return f"{e.value} hint: {e.value.hint}"

    msg = problem(f"cluster:\n  redis: redis://127.0.0.1:6379/0\n  tls_ca: {pem}\n")
    assert "gpulock.yaml:3" in msg and "cluster.tls_ca" in msg and "rediss://" in msg, msg
    msg = problem("cluster:\n  redis: rediss://127.0.0.1:6380/0\n  tls_ca: missing.pem\n")
    assert "cluster.tls_ca" in msg and "cannot read" in msg and "missing.pem" in msg, msg
    msg = problem("cluster:\n  redis: rediss://127.0.0.1:6380/0\n  tls_ca: notpem.txt\n")
    assert "cluster.tls_ca" in msg and "not a PEM file" in msg and "hello" not in msg, msg
    msg = problem(f"cluster:\n  redis: rediss://127.0.0.1:6380/0\n  tls_cert: {pem}\n")
    assert "cluster.tls_key" in msg and "both tls_cert and tls_key" in msg, msg
    msg = problem("cluster:\n  redis: rediss://127.0.0.1:6380/0?ssl_cert_reqs=none\n")
    assert "cluster.redis" in msg and "ssl_cert_reqs" in msg and "tls_ca" in msg, msg
    path = tmp_path / "gpulock.yaml"
    path.write_text(f"cluster: {{redis: 'rediss://127.0.0.1:6380/0', host: x, tls_ca: {pem}}}\n")
    cc = cluster_config.load(load_config(str(path)))
    assert cc is not None and cc.tls and cc.tls_ca == str(pem)


def test_a_frozen_tls_redis_costs_one_short_timeout(tls_redis: TlsRedis) -> None:
    """SIGSTOP: the kernel still accepts the connection, and the TLS handshake gets no answer."""
    assert tls_redis.certs is not None
    cc = ClusterConfig(redis_url=tls_redis.url, host="f", tls_ca=str(tls_redis.certs.ca))
    store = Store(cc)
    tls_redis.freeze()
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"no answer within 0\.5s"):
            store.hosts()
        assert time.monotonic() - started < HANG_BOUND_S  # the timeout is 0.5 s: no hang
    finally:
        tls_redis.thaw()
    assert isinstance(Store(cc).hosts(), list)  # thawed: a fresh connection works again


def test_a_redis_that_asks_for_a_client_certificate_gets_tls_cert(tmp_path: Path) -> None:
    need_redis()
    certs = make_certs(tmp_path / "certs")
    server = TlsRedis(tmp_path / "redis", certs=certs, auth_clients="yes").start()
    try:
        folder = certs.ca.parent
        with_cert = ClusterConfig(
            redis_url=server.url, host="a", tls_ca=str(certs.ca),
            tls_cert=str(folder / "client.pem"), tls_key=str(folder / "client.key"),
        )  # fmt: skip
        assert Store(with_cert).hosts() == []
        without = ClusterConfig(redis_url=server.url, host="a", tls_ca=str(certs.ca))
        with pytest.raises(Unavailable, match=r"redis unavailable: TLS: .*client certificate"):
            Store(without).hosts()
    finally:
        server.stop()
