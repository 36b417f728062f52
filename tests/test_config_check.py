"""``gpulock config check``, ``gpulock status``'s line about the other sections, and ``gpulock
files``: a typo in a section that only a service reads is found now, not at 3 a.m."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import Cli, assert_clean_error

# One typo in each section a service reads, each a near miss of a real key.
TYPOS = """\
reserve: 10%
router:
  daily_budjet: 5.00
watchdog:
  treshold: 80%
governor:
  sampels: 3
serve:
  listne: 127.0.0.1:11435
cluster:
  redis: redis://127.0.0.1:6379/0
  heartbaet: 2s
routes:
  summarize:
    - {tier: cpu, backend: llama_cpp, model: /m/tiny.gguf, name: tiny-cpu}
"""
EXPECTED = {
    "router.daily_budjet": (3, "daily_budget"),
    "watchdog.treshold": (5, "threshold"),
    "governor.sampels": (7, "samples"),
    "serve.listne": (9, "listen"),
    "cluster.heartbaet": (12, "heartbeat"),
}


def _config(cli: Cli, text: str) -> Path:
    path = cli.root / "gpulock.yaml"
    path.write_text(text)
    return path


def test_every_sections_problem_is_named_with_file_line_key_and_a_guess(cli: Cli) -> None:
    path = _config(cli, TYPOS)
    r = cli.run("config", "check", "--config", str(path))
    assert r.code == 1, r.describe()
    for key, (line, guess) in EXPECTED.items():
        assert f"{path}:{line}: {key}: unknown key" in r.stdout, (key, r.stdout)
        assert f"did you mean {guess!r}?" in r.stdout, (guess, r.stdout)
    assert r.stdout.rstrip().endswith(f"{path}: 5 problems"), r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    doc = cli.run("config", "check", "--config", str(path), "--json").json()
    assert doc["ok"] is False and doc["file"] == str(path)
    found = {p["key"]: (p["line"], p["hint"]) for p in doc["problems"]}
    assert set(found) == set(EXPECTED), found
    assert all(f"did you mean {EXPECTED[k][1]!r}?" in h for k, (_, h) in found.items())


def test_status_and_run_still_work_and_status_says_there_is_a_problem(cli: Cli) -> None:
    path = _config(cli, TYPOS)
    assert cli.run("run", "--config", str(path), "--", "true").code == 0
    r = cli.run("status", "--config", str(path))
    assert r.code == 0, r.describe()
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("config: ")]
    assert "router.daily_budjet" in line and "(and 4 more)" in line, line
    assert "gpulock config check" in line
    doc = cli.run("status", "--config", str(path), "--json").json()
    assert len(doc["config_problems"]) == 5, doc["config_problems"]


def test_top_level_problems_are_all_listed(cli: Cli) -> None:
    path = _config(cli, "reserv: 10%\ndefault_gpu: -3\nexit_wait: soon\nserve: {max_queue: 8}\n")
    r = cli.run("config", "check", "--config", str(path))
    assert r.code == 1, r.describe()
    assert f"{path}:1: reserv: unknown key" in r.stdout and "did you mean 'reserve'?" in r.stdout
    assert f"{path}:2: default_gpu:" in r.stdout and f"{path}:3: exit_wait:" in r.stdout
    assert "3 problems" in r.stdout, r.stdout


def test_a_clean_config_and_no_config(cli: Cli) -> None:
    path = _config(
        cli, "reserve: 10%\nserve: {listen: 127.0.0.1:11435}\nwatchdog: {threshold: 80%}\n"
    )
    r = cli.run("config", "check", "--config", str(path))
    assert (r.code, r.stdout.strip()) == (0, f"{path}: ok (gpulock's keys, serve, watchdog)")
    cli.state.mkdir(mode=0o700)
    assert cli.run("status", "--config", str(path), "--json").json()["config_problems"] == []
    elsewhere = cli.root / "elsewhere"
    elsewhere.mkdir()
    r = cli.run("config", "check", cwd=elsewhere)  # none found: every default applies
    assert r.code == 0 and "no config file" in r.stdout, r.describe()


def test_not_yaml_is_one_problem_and_usage_errors_exit_2(cli: Cli) -> None:
    path = _config(cli, "serve: [unclosed\n")
    r = cli.run("config", "check", "--config", str(path), "--json")
    doc = r.json()
    assert r.code == 1 and not doc["ok"] and len(doc["problems"]) == 1, doc
    r = cli.run("config", "chek")
    assert_clean_error(r, 2)
    assert "did you mean 'check'?" in r.stderr
    r = cli.run("config", "check", "--config", str(cli.root / "missing.yaml"))
    assert_clean_error(r, 1)


def test_files_lists_what_ships_and_prints_one_path(cli: Cli) -> None:
    doc = cli.run("files", "--json").json()
    names = {f["name"]: f for f in doc["files"]}
    assert {"crontab", "grafana", "governor.service", "fleet.service", "serve.service"} <= set(
        names
    )
    assert all(f["exists"] for f in doc["files"]), doc
    r = cli.run("files", "grafana")
    assert r.code == 0 and json.loads(Path(r.stdout.strip()).read_text())["panels"]
    # the file's own name works too
    assert cli.run("files", "gpulock-governor.service").stdout.strip().endswith(".service")
    r = cli.run("files", "grafna")
    assert_clean_error(r, 2)
    assert "did you mean 'grafana'?" in r.stderr and "crontab" in r.stderr


@pytest.mark.parametrize("section", ["serve", "watchdog", "router", "cluster", "agents"])
def test_unknown_keys_guess_alike_in_every_section(cli: Cli, section: str) -> None:
    known = {"serve": "listen", "watchdog": "threshold", "router": "cooldown", "cluster": "redis",
             "agents": "modules"}[section]  # fmt: skip
    path = _config(cli, f"{section}:\n  {known}x: 1\n")
    doc = cli.run("config", "check", "--config", str(path), "--json").json()
    hints = [p["hint"] for p in doc["problems"] if p["key"] == f"{section}.{known}x"]
    assert hints and hints[0].startswith(f"did you mean {known!r}? known keys: "), doc


def test_every_section_the_config_keeps_has_a_checker() -> None:
    """A section added to the config (``SECTIONS``) without a ``gpulock.config`` entry point
    would pass ``gpulock config check`` unread."""
    from gpulock.core.config import SECTIONS
    from gpulock.core.sections import checkers

    assert set(SECTIONS) - set(checkers()) == set()
