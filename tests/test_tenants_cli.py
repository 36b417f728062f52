"""``gpulock tenants`` and ``gpulock evict --tenant`` as a user runs them."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import Cli, assert_clean_error
from standins.bad import Bad
from standins.ollama import Ollama
from tenant_helpers import write_config

GiB = 1024**3


def test_tenants_lists_each_tenant_its_models_and_errors(cli: Cli, tmp_path: Path) -> None:
    o = Ollama({"qwen2.5:7b": 5 * GiB}).start()
    bad = Bad("500").start()
    try:
        o.load("qwen2.5:7b")
        cfg = write_config(
            tmp_path,
            [{"name": "ollama", "kind": "ollama", "url": o.url},
             {"name": "broken", "kind": "localai", "url": bad.url}],
        )  # fmt: skip
        env = cli.env(GPULOCK_CONFIG=str(cfg))
        r = cli.run("tenants", "--json", env=env)
        assert r.code == 0, r.describe()
        ollama, broken = r.json()["tenants"]
        assert ollama["reachable"] and ollama["actual_kind"] == "ollama"
        (m,) = ollama["models"]
        assert (m["id"], m["state"], m["size_bytes"]) == ("ollama/qwen2.5:7b", "loaded", 5 * GiB)
        assert m["idle_s"] is None  # first sighting
        assert not broken["reachable"] and "HTTP 500" in broken["error"]
        r = cli.run("tenants", env=env)
        assert "qwen2.5:7b  loaded  5.0 GiB" in r.stdout, r.describe()
        assert "broken  localai" in r.stdout and "unreachable: GET /system: HTTP 500" in r.stdout
        r = cli.run("status", env=env)
        assert "ollama/qwen2.5:7b" in r.stdout and "tenant broken" in r.stdout
    finally:
        o.stop()
        bad.stop()


def test_tenants_without_any_configured(cli: Cli) -> None:
    r = cli.run("tenants")
    assert r.code == 0 and "no tenants configured" in r.stdout
    assert cli.run("tenants", "--json").json() == {"tenants": []}


def test_evict_with_an_unknown_tenant_lists_the_known_ones(cli: Cli, tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, [{"name": "ollama", "kind": "ollama", "url": "http://127.0.0.1:9"}]
    )
    r = cli.run("evict", "m", "--tenant", "olama", env=cli.env(GPULOCK_CONFIG=str(cfg)))
    assert_clean_error(r, 1)
    assert "no tenant 'olama'" in r.stderr and "tenants: ollama" in r.stderr


def test_evict_by_tenant_frees_and_exits_0(cli: Cli, tmp_path: Path) -> None:
    o = Ollama({"qwen2.5:7b": 5 * GiB}).start()
    try:
        o.load("qwen2.5:7b")
        cfg = write_config(tmp_path, [{"name": "ollama", "kind": "ollama", "url": o.url}])
        r = cli.run("evict", "ollama/qwen2.5:7b", env=cli.env(GPULOCK_CONFIG=str(cfg)))
        assert r.code == 0, r.describe()
        assert "freed" in r.stdout and "keep_alive 0 accepted" in r.stdout
        assert o.loaded == {}
    finally:
        o.stop()


def test_a_bad_tenants_section_is_a_clean_error(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "tenants:\n"
        "  - {name: x, kind: ollama, url: 'http://h:1', api_key_env: sk-abc123def456ghi789jkl}\n"
    )
    r = cli.run("tenants", env=cli.env(GPULOCK_CONFIG=str(cfg)))
    assert_clean_error(r, 1)
    assert "bad.yaml:2: tenants[0].api_key_env" in r.stderr
    assert "sk-abc123" not in r.stderr


def test_a_tenant_model_never_seen_in_use_shows_idle_as_unknown(cli: Cli, tmp_path: Path) -> None:
    o = Ollama({"qwen2.5:7b": 5 * GiB}).start()
    try:
        o.load("qwen2.5:7b")
        cfg = write_config(tmp_path, [{"name": "ollama", "kind": "ollama", "url": o.url}])
        env = cli.env(GPULOCK_CONFIG=str(cfg))
        cli.state.mkdir(mode=0o700)

        def row() -> tuple[dict[str, object], str]:
            doc = cli.run("status", "--json", env=env).json()
            [m] = doc["residents"]
            text = cli.run("status", env=env).stdout
            [line] = [ln for ln in text.splitlines() if ln.strip().startswith("qwen2.5:7b ")]
            return m, line

        m, line = row()  # first sighting: nothing known
        assert m["idle_s"] is None and m["last_use_seen"] is False, m
        m, line = row()  # seen again unchanged: idle at least since then, a lower bound
        assert m["idle_s"] is not None and m["last_use_seen"] is False, m
        assert line.split()[7] == "?", line  # NAME ID PID GPU SIZE(2) POLICY IDLE
        o.load("qwen2.5:7b")  # a use: the fingerprint (expires_at) moves
        m, line = row()
        assert m["last_use_seen"] is True and m["idle_s"] is not None, m
        assert line.split()[7] not in ("?", "-"), line
    finally:
        o.stop()
