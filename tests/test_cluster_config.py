"""The ``cluster:`` section: its keys, its defaults, the refusals (a password in the URL is
never echoed), and the promise that nothing of the cluster loads without it or on the lock's
paths (``import gpulock``, ``gpulock run``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulock.cluster import config as cc_mod
from gpulock.core.config import parse_config
from gpulock.core.errors import ConfigError

FILE = "/etc/gpulock.yaml"
SECRET = "hunter2-s3cret"  # noqa: S105 (a made-up one, to show it is never echoed)


def load(text: str, **env: str) -> cc_mod.ClusterConfig | None:
    return cc_mod.load(parse_config(textwrap.dedent(text), FILE), environ=env)


def refused(text: str, **env: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load(text, **env)
    return e.value


def test_no_section_means_no_cluster() -> None:
    assert load("simulate: 24GiB\n") is None


def test_defaults_and_every_key() -> None:
    c = load("cluster: {redis: 'redis://10.0.0.5:6379/0', host: a}\n")
    assert c is not None
    assert (c.redis_url, c.host, c.prefix) == ("redis://10.0.0.5:6379/0", "a", "gpulock:")
    assert (c.heartbeat_s, c.remote_penalty_s, c.peer_timeout_s) == (2.0, 1.0, 5.0)
    assert c.ttl_s == 6.0  # a host silent for 3 heartbeats is gone
    assert c.gateway is None and c.api_key_env is None and c.password_env is None
    c = load(
        """\
        cluster:
          redis: rediss://cache.example:6380/2
          password_env: REDIS_PW
          prefix: "lab:"
          host: box-3090
          gateway: http://10.0.0.7:11435/
          api_key_env: PEER_KEY
          heartbeat: 500ms
          remote_penalty: 2s
          peer_timeout: 3s
        """,
        REDIS_PW="pw",
    )
    assert c is not None
    assert (c.prefix, c.host, c.gateway) == ("lab:", "box-3090", "http://10.0.0.7:11435")
    assert (c.heartbeat_s, c.remote_penalty_s, c.peer_timeout_s) == (0.5, 2.0, 3.0)
    assert c.password({"REDIS_PW": "pw"}) == "pw" and c.api_key_env == "PEER_KEY"
    assert load("cluster: {redis: 'unix:///run/redis.sock'}\n") is not None


def test_gpulock_host_wins_over_the_config_and_the_hostname() -> None:
    c = load("cluster: {redis: 'redis://h:6379/0', host: a}\n", GPULOCK_HOST="b")
    assert c is not None and c.host == "b"
    c = load("cluster: {redis: 'redis://h:6379/0'}\n")
    assert c is not None and c.host  # the hostname


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@10.0.0.5:6379/0",
        f"redis://default:{SECRET}@10.0.0.5:6379/0",
        f"rediss://u:{SECRET}@h/0",
        f"redis://10.0.0.5:6379/0?password={SECRET}",
    ],
)
def test_a_password_in_the_url_is_refused_without_echoing_it(url: str) -> None:
    e = refused(f"cluster:\n  redis: '{url}'\n")
    text = f"{e} {e.hint}"
    assert "password" in str(e) and e.key == "cluster.redis" and e.line == 2
    assert SECRET not in text and url not in text
    assert "password_env" in (e.hint or "")


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [
        ("cluster: {}\n", "cluster.redis", "missing"),
        ("cluster: {redis: 'http://h:1/0'}\n", "cluster.redis", "redis://, rediss://, unix://"),
        ("cluster: {redis: 'redis://h:99999/0'}\n", "cluster.redis", "port"),
        ("cluster: {redis: 'redis://h/0', heartbeat: 'soon'}\n", "cluster.heartbeat", "soon"),
        ("cluster: {redis: 'redis://h/0', heartbeat: 0}\n", "cluster.heartbeat", "at least"),
        ("cluster: {redis: 'redis://h/0', gateway: 'ftp://x'}\n", "cluster.gateway", "http://"),
        ("cluster: {redis: 'redis://h/0', hearbeat: 1s}\n", "cluster.hearbeat", "heartbeat"),
        ("cluster: [1]\n", "cluster", "mapping"),
    ],
)
def test_bad_values_name_the_key(text: str, key: str, needle: str) -> None:
    e = refused(text)
    assert e.key == key and e.file == FILE
    assert needle in f"{e} {e.hint}"


def test_a_secret_pasted_as_a_variable_name_is_not_echoed() -> None:
    e = refused(f"cluster: {{redis: 'redis://h/0', password_env: '{SECRET}-x'}}\n")
    assert e.key == "cluster.password_env" and SECRET not in f"{e} {e.hint}"
    e = refused(f"cluster: {{redis: 'redis://h/0', api_key_env: 'sk {SECRET}'}}\n")
    assert e.key == "cluster.api_key_env" and SECRET not in f"{e} {e.hint}"


LOADED = "sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'cluster'))"


def test_nothing_of_the_cluster_loads_on_the_locks_paths(tmp_path: Path) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text("simulate: 8GiB\ncluster: {redis: 'redis://127.0.0.1:9/0', host: a}\n")
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(tmp_path / "state")}
    code = (
        "import json, sys\n"
        "import gpulock, gpulock.cli\n"
        "rc = gpulock.cli.main(['run', '--', 'true'])\n"
        "snap = gpulock.cli.main(['status', '--json'])\n"
        f"print(json.dumps({{'rc': rc, 'loaded': {LOADED}}}))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(env), timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {"rc": 0, "loaded": []}, r.stdout


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    return {**env, **extra}


def test_the_command_is_declared_for_gpulock() -> None:
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'cluster = "gpulock.cluster.cli:main"' in text
    assert 'cluster = ["redis>=8.0"]' in text
