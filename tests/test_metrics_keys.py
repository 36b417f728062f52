"""The governor's metrics listener binds loopback unless bearer keys are configured.

``metrics.api_keys_env`` names a variable holding the key(s); with keys, every scrape needs
``Authorization: Bearer KEY`` (401 otherwise).  Real governor processes, a real HTTP client.
"""

from __future__ import annotations

import io
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cli_helpers import GPULOCK, Cli, assert_clean_error, wait_until
from procs import World

from gpulock.metrics import config as mconfig

pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")

KEY_ENV = "GPULOCK_METRICS_KEYS"
SECRET = "s3cret-metrics-key"  # noqa: S105 (a test key)
OTHER = "second-key"


def _url(err: Path) -> str | None:
    for line in err.read_text().splitlines():
        if "metrics on " in line:
            return line.rsplit(" ", 1)[-1]
    return None


def _get(url: str, key: str | None) -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(url)  # noqa: S310 (a 127.0.0.1 URL)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


@pytest.mark.parametrize("how", ["config", "flag"])
def test_a_non_loopback_listener_without_keys_refuses_to_start(
    world: World, cli: Cli, how: str
) -> None:
    if how == "config":
        world.config.write_text("metrics: {listen: '0.0.0.0:0'}\n")
        r = cli.run("governor", "--once", "--config", str(world.config))
    else:
        world.config.write_text("# nothing\n")
        r = cli.run(
            "governor", "--once", "--config", str(world.config), "--metrics-listen", "0.0.0.0:0"
        )
    assert_clean_error(r, 2)
    assert "refusing to serve metrics on 0.0.0.0:0 without API keys" in r.stderr, r.describe()
    assert "metrics.api_keys_env" in r.stderr, r.describe()


def test_keys_named_but_not_set_refuse_and_never_echo_a_pasted_key(world: World, cli: Cli) -> None:
    world.config.write_text(f"metrics: {{listen: '0.0.0.0:0', api_keys_env: {KEY_ENV}}}\n")
    r = cli.run(
        "governor", "--once", "--config", str(world.config), env=cli.env(**{KEY_ENV: " , "})
    )
    assert_clean_error(r, 2)
    assert f"{KEY_ENV}, which holds no key" in r.stderr, r.describe()
    # A key pasted where the variable's name belongs: a config error that does not echo it.
    world.config.write_text(f"metrics: {{listen: '127.0.0.1:0', api_keys_env: '{SECRET}'}}\n")
    r = cli.run("governor", "--once", "--config", str(world.config))
    assert_clean_error(r, 1)
    assert "metrics.api_keys_env" in r.stderr and SECRET not in r.stderr, r.describe()


def test_with_keys_every_scrape_needs_a_bearer_key(world: World, cli: Cli) -> None:
    world.config.write_text(f"metrics: {{listen: '127.0.0.1:0', api_keys_env: {KEY_ENV}}}\n")
    gov = cli.start(
        [*GPULOCK, "governor", "--config", str(world.config)],
        "governor",
        env=cli.env(**{KEY_ENV: f"{SECRET}, {OTHER}"}),
    )
    url = wait_until(lambda: _url(gov.err), lambda: f"the metrics URL\n{gov.output()}")
    code, body, headers = _get(url, None)
    assert code == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), body
    assert _get(url, "wrong")[0] == 401
    assert _get(url.replace("/metrics", "/"), "wrong")[0] == 401  # every path, not /metrics only
    for key in (SECRET, OTHER):
        code, body, _ = _get(url, key)
        assert code == 200 and "gpulock_" in body, body
    gov.kill_group()
    assert SECRET not in gov.output() and OTHER not in gov.output(), gov.output()


def test_listen_keys_decides_from_the_address_and_the_variable() -> None:
    wide = mconfig.Listen("0.0.0.0", 9464)  # noqa: S104 (never bound)
    local = mconfig.Listen("127.0.0.1", 9464)
    assert mconfig.listen_keys(local, None, {}) == ()
    assert mconfig.listen_keys(wide, KEY_ENV, {KEY_ENV: "a,b c"}) == ("a", "b", "c")
    assert mconfig.listen_keys(local, KEY_ENV, {KEY_ENV: "a"}) == ("a",)
    for listen, env in ((wide, None), (wide, KEY_ENV), (local, KEY_ENV)):
        with pytest.raises(mconfig.MetricsListenError) as e:
            mconfig.listen_keys(listen, env, {})
        assert e.value.exit_code == 2


def test_the_exporter_itself_refuses_an_open_non_loopback_listener(world: World) -> None:
    """Whoever builds an Exporter (the governor, gpulock serve) gets the same rule."""
    from gpulock.metrics.exporter import Exporter

    wide = mconfig.Listen("0.0.0.0", 0)  # noqa: S104 (refused before any bind)
    exporter = Exporter(world.settings(), listen=wide, textfile=None, err=io.StringIO())
    with pytest.raises(mconfig.MetricsListenError, match="without API keys"):
        exporter.start()
    assert exporter.server is None
