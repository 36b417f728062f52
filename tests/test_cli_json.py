"""With ``--json``, every command's errors are JSON too, and the passes and runs that print
results have a ``--json`` form (``governor --once``, ``agent run``, ``fleet --once``).

An error is one object on stdout, nothing on stderr, the usual exit code:
``{"error": {"message", "hint", "type", "exit_code"}}``.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import Cli, assert_clean_error


def error_of(r: object) -> dict[str, object]:
    doc = json.loads(r.stdout)  # type: ignore[attr-defined]
    assert set(doc) == {"error"}
    err: dict[str, object] = doc["error"]
    assert set(err) == {"message", "hint", "type", "exit_code"}
    return err


def test_evict_of_an_unknown_name_answers_json(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)
    r = cli.run("evict", "nosuch", "--json")
    assert (r.code, r.stderr) == (1, ""), r.describe()
    err = error_of(r)
    assert err["message"] == "no resident model 'nosuch'"
    assert (err["hint"], err["exit_code"]) == ("none is registered", 1)
    # without --json: the error: and hint: lines, as before
    assert_clean_error(cli.run("evict", "nosuch"), 1)


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["agent", "run", "digets"], "did you mean 'digest'? known agents: "),
        (["replay", "--gpu", "24GiB", "--policy", "foresigt"], "did you mean 'foresight'? known: "),
    ],
)
def test_an_unknown_name_gets_a_guess(cli: Cli, args: list[str], hint: str) -> None:
    cli.state.mkdir(mode=0o700)
    r = cli.run(*args, "--json")
    assert r.code == 2, r.describe()
    assert error_of(r)["hint"].startswith(hint), r.describe()


def test_usage_mistakes_and_plugins_answer_json(cli: Cli) -> None:
    r = cli.run("status", "--json", "--bogus")
    assert (r.code, r.stderr) == (2, ""), r.describe()
    err = error_of(r)
    assert err["type"] == "UsageError" and err["exit_code"] == 2
    assert err["message"] == "unrecognized arguments: --bogus"
    cfg = cli.root / "gpulock.yaml"
    cfg.write_text("routes:\n  summarize: [{tier: cpu, backend: llama_cpp, model: /m.gguf}]\n")
    r = cli.run("route", "summarise", "--json", "--config", str(cfg))
    assert (r.code, r.stderr) == (2, ""), r.describe()
    err = error_of(r)
    assert (err["type"], err["hint"]) == (
        "UnknownTask",
        "did you mean 'summarize'? known tasks: summarize",
    )
    r = cli.run("history", "--json", "--since", "yesterday-ish")
    assert r.code == 2 and error_of(r)["type"] == "UsageError", r.describe()
    r = cli.run("report", "--json", "--out", str(cli.root / "no" / "such" / "r.html"))
    assert r.code == 1 and r.stderr == "" and error_of(r)["hint"], r.describe()


def test_json_after_the_double_dash_is_the_commands_own(cli: Cli) -> None:
    r = cli.run("run", "--timeout", "banana", "--", "echo", "--json")
    assert_clean_error(r, 2)
    assert r.stdout == ""


def test_governor_once_json(cli: Cli) -> None:
    r = cli.run("governor", "--once", "--dry-run", "--json")
    assert r.code == 0, r.describe()
    doc = json.loads(r.stdout)
    assert {k: doc[k] for k in ("dry_run", "level", "actions", "lines")} == {
        "dry_run": True, "level": "normal", "actions": [], "lines": []
    }  # fmt: skip
    assert {"level_before", "signals", "thresholds"} <= set(doc), doc  # the decision's grounds
    r = cli.run("governor", "--json")
    assert (r.code, r.stderr) == (2, ""), r.describe()
    assert error_of(r)["message"] == "--json goes with --once"
