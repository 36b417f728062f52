"""``gpulock history``'s human lines: nested fields (a governor's ``evidence``, a route's
``model``) read as ``key.sub=value`` with units, never as Python reprs (``{'model': ...}``)."""

from __future__ import annotations

import json

from cli_helpers import Cli


def test_nested_fields_read_as_dotted_keys_with_units(cli: Cli) -> None:
    assert cli.run("run", "--name", "warmup", "--", "true").code == 0  # makes the state folder
    events = [
        {
            "ts": 1795214087.5,
            "event": "escalate",
            "level": "reduce",
            "from_level": "normal",
            "reason": "vram_pressure 0.97 > 0.95 for 3 passes",
            "evidence": {"gpu0": {"used_bytes": 9 * 2**30, "frac": 0.97}, "psi_some": None},
        },
        {
            "ts": 1795214088.0,
            "event": "governor",
            "action": "evict",
            "outcome": "freed",
            "evidence": {"model": "qwen-7b", "idle_s": 720.0, "in_use": False},
            "tiers": ["gpu", "cpu"],
            "odd": [{"x": 1}],
        },
    ]
    with open(cli.state / "events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    r = cli.run("history", "--event", "escalate", "--event", "governor")
    assert r.code == 0, r.describe()
    escalate, governor = r.stdout.splitlines()
    assert "{'" not in r.stdout and "None" not in r.stdout, r.stdout
    assert escalate.endswith(
        "level=reduce from_level=normal reason=vram_pressure 0.97 > 0.95 for 3 passes "
        "evidence.gpu0.used_bytes=9.0 GiB evidence.gpu0.frac=0.97"
    ), escalate
    assert governor.endswith(
        "action=evict outcome=freed evidence.model=qwen-7b evidence.idle_s=12m00s "
        'evidence.in_use=false tiers=gpu,cpu odd=[{"x":1}]'
    ), governor


def _write(cli: Cli, events: list[dict[str, object]]) -> None:
    with open(cli.state / "events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_columns_stay_in_step_whatever_the_event_kind(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)
    ts = 1795214087.0
    _write(
        cli,
        [
            {"ts": ts, "event": "wait", "gpu": 0, "ticket": 7, "pid": 41, "name": "digest"},
            {"ts": ts + 1, "event": "model-load", "gpu": 0, "name": "tiny-gpu", "load_s": 1.5},
            {"ts": ts + 2, "event": "deescalate", "level": "normal", "from_level": "reduce"},
            {"ts": ts + 3, "event": "gateway-request", "task": "summarize", "outcome": "ok"},
            {"ts": ts + 4, "event": "acquire", "gpu": 0, "ticket": 7, "pid": 41, "name": "digest"},
        ],
    )
    r = cli.run("history")
    assert r.code == 0, r.describe()
    lines = r.stdout.splitlines()
    assert len(lines) == 5, r.stdout
    # The GPU column starts at one place on every line, the details at another.
    gpu_at = {line.index(" gpu0 ") if " gpu0 " in line else line.index(" - ") for line in lines}
    assert len(gpu_at) == 1, r.stdout
    assert lines[1].index("load_s=") == lines[3].index("task="), r.stdout


def test_a_refused_request_shows_no_empty_fields(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)
    _write(
        cli,
        [
            {
                "ts": 1795214087.0,
                "event": "gateway-request",
                "task": "",
                "tier": "",
                "model": "",
                "outcome": "refused",
                "status": 401,
            }
        ],
    )
    r = cli.run("history")
    assert r.code == 0, r.describe()
    assert "task=" not in r.stdout and "tier=" not in r.stdout and "model=" not in r.stdout
    assert r.stdout.rstrip().endswith("outcome=refused status=401"), r.stdout


def test_an_unknown_event_kind_is_refused_naming_the_known_ones(cli: Cli) -> None:
    assert cli.run("run", "--name", "warmup", "--", "true").code == 0
    r = cli.run("history", "--event", "aquire")
    assert r.code == 2 and "Traceback" not in r.stderr, r.describe()
    assert "error: --event: no event kind 'aquire'" in r.stderr, r.describe()
    assert "hint: did you mean 'acquire'? kinds: " in r.stderr, r.describe()
    assert "gateway-request" in r.stderr and "leave" in r.stderr, r.describe()
    r = cli.run("history", "--event", "nosuch", "--json")
    assert r.code == 2 and r.json()["error"]["exit_code"] == 2, r.describe()
    # A kind only the log knows (a plugin's) is one of the known ones.
    _write(cli, [{"ts": 1795214087.0, "event": "my-plugin-thing", "x": 1}])
    r = cli.run("history", "--event", "my-plugin-thing")
    assert r.code == 0 and "x=1" in r.stdout, r.describe()
