"""Garbage in the state folder, the config and the command line: skipped or refused with an
``error:`` naming what is wrong, never a traceback and never a hang.

The CLI cases run the real ``gpulock`` (``Cli``); a hang fails the test at ``RUN_S``.  The
config and record cases call the parsers directly.  The last test is a small fixed fuzz: a
list of mutated command lines for every command, each of which must end without a traceback.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from cli_helpers import Cli, Result, assert_clean_error, error_lines

from gpulock.core import safejson
from gpulock.core.config import parse_config
from gpulock.core.errors import ConfigError
from gpulock.governor import config as governor_config
from gpulock.lock import ticket
from gpulock.residents import registry
from gpulock.router.routes import load_table

DEEP = b"[" * 100_000


def no_traceback(r: Result) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.describe()


def started(cli: Cli) -> None:
    """The state folder as gpulock makes it: one run through the queue."""
    r = cli.run("run", "--", "true")
    assert r.code == 0, r.describe()


# --- bounded readers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [DEEP, b'{"a":' * 50_000, b'["\\\\' + b"[" * 40 + b'"]', b'{"x": NaN}', b'{"x": 1e999}'],
    ids=["deep-list", "deep-object", "brackets-in-a-string", "nan", "overflow"],
)
def test_bounded_json_refuses_what_would_crash_a_reader(data: bytes) -> None:
    if data.startswith(b'["'):
        assert safejson.loads(data) == ["\\" + "[" * 40]  # brackets in a string are text
        return
    with pytest.raises(ValueError):
        safejson.loads(data)


def test_a_deep_ticket_is_garbage_not_a_recursion_error() -> None:
    with pytest.raises(ticket.TicketFormatError, match="nested deeper"):
        ticket.parse(DEEP)


def test_a_resident_record_is_type_checked_field_by_field() -> None:
    good = {
        "format": registry.FORMAT,
        "id": "12-34-1",
        "name": "m",
        "gpu": 0,
        "owner": "12-34",
        "pid": 12,
        "uid": 0,
        "user": "root",
        "program": "p",
        "policy": "persistent",
        "loaded_wall": 1.0,
        "last_used_wall": 1.0,
    }
    assert registry.parse(json.dumps(good).encode()).owner == "12-34"
    bad: list[dict[str, object]] = [
        {"owner": "../../etc/x"},  # names the claim's path: digits only
        {"owner": "99-34"},  # another pid's claim
        {"declared_bytes": "6GiB"},
        {"in_use": "yes"},
        {"loaded_wall": [1]},
        {"pid": True},
        {"pid": -1},
    ]
    for change in bad:
        with pytest.raises(ValueError):
            registry.parse(json.dumps({**good, **change}).encode())
    with pytest.raises(ValueError):
        registry.parse(DEEP)


def test_garbage_that_crashed_status_and_run_is_skipped(cli: Cli) -> None:
    started(cli)
    (cli.gpu_dir() / "000000000009.ticket").write_bytes(DEEP)
    residents = cli.state / "residents"
    residents.mkdir(mode=0o700)
    (residents / "12-34-1.json").write_bytes(DEEP)
    os.mkfifo(residents / "12-34-2.json")  # must not block a reader
    (cli.state / "gpu1").write_text("not a queue")

    r = cli.run("status")
    assert r.code == 0, r.describe()
    assert "000000000009.ticket: not JSON (nested deeper" in r.stdout, r.describe()
    [gpu] = cli.status()["gpus"]
    assert "nested deeper" in gpu["ignored"][0]["reason"]
    for args in (("break", "--stale"), ("run", "--", "true"), ("governor", "--once")):
        r = cli.run(*args)
        assert r.code == 0, r.describe()
        no_traceback(r)
    r = cli.run("evict", "x")
    assert_clean_error(r, 1)

    os.unlink(residents / "12-34-1.json")
    os.unlink(residents / "12-34-2.json")
    residents.rmdir()
    residents.write_text("not a folder")
    r = cli.run("status", "--json")
    assert r.code == 0, r.describe()
    assert [g["gpu"] for g in r.json()["gpus"]] == [0]


def test_break_stale_cleans_garbage_tickets_it_owns_and_leaves_folders(cli: Cli) -> None:
    started(cli)
    (cli.gpu_dir() / "000000000007.ticket").write_bytes(DEEP)
    (cli.gpu_dir() / "000000000008.ticket").mkdir()
    r = cli.run("break", "--stale")
    assert r.code == 0, r.describe()
    assert "ticket 7 (gpu0): removed: garbage: not JSON" in r.stdout, r.describe()
    assert cli.queue_files() == ["000000000008.ticket"]
    [event] = cli.events("break", ticket=7)
    assert event["action"] == "removed" and event["reason"].startswith("garbage")


@pytest.mark.parametrize("kind", ["folder", "fifo", "symlink"])
def test_a_seq_file_that_is_no_file_is_refused_by_name(cli: Cli, kind: str) -> None:
    started(cli)
    seq = cli.state / ".seq"
    seq.unlink()
    if kind == "folder":
        seq.mkdir()
    elif kind == "fifo":
        os.mkfifo(seq)
    else:
        seq.symlink_to(cli.root / "elsewhere")
    r = cli.run("run", "--", "true")
    assert_clean_error(r, 1)
    assert str(seq) in error_lines(r.stderr)[0], r.describe()


def test_history_skips_an_event_whose_time_no_clock_gives(cli: Cli) -> None:
    started(cli)
    with open(cli.state / "events.jsonl", "a") as f:
        for ts in ("1e308", "-5", "NaN", "true"):
            f.write(f'{{"ts": {ts}, "event": "acquire", "gpu": 0}}\n')
    for args in (("history",), ("history", "--json")):
        r = cli.run(*args)
        assert r.code == 0, r.describe()
        no_traceback(r)


def test_a_fifo_in_place_of_governor_json_hangs_nothing(cli: Cli) -> None:
    started(cli)
    os.mkfifo(cli.state / "governor.json")
    for args in (("status",), ("status", "--json"), ("run", "--", "true")):
        r = cli.run(*args)  # a hang fails here, at RUN_S
        assert r.code == 0, r.describe()


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("route", "summarize"),
        ("governor", "--once"),
        ("fleet", "FLEET", "--dry-run"),
    ],
)
def test_a_config_that_cannot_be_read_without_blocking_is_refused_by_name(
    cli: Cli, args: tuple[str, ...]
) -> None:
    fifo = cli.root / "config.yaml"
    os.mkfifo(fifo)
    fleet = cli.root / "fleet.yaml"
    fleet.write_text("agents:\n  - {name: digest, schedule: '@hourly'}\n")
    argv = [str(fleet) if a == "FLEET" else a for a in args]
    for r in (
        cli.run(*argv, "--config", str(fifo)),
        cli.run(*argv, env=cli.env(GPULOCK_CONFIG=str(fifo))),
    ):
        assert_clean_error(r, 1)
        assert str(fifo) in error_lines(r.stderr)[0], r.describe()


def test_a_fleet_file_that_is_a_fifo_is_refused_by_name(cli: Cli) -> None:
    fifo = cli.root / "fleet.yaml"
    os.mkfifo(fifo)
    r = cli.run("fleet", str(fifo), "--dry-run")
    assert r.code != 0 and str(fifo) in r.stderr, r.describe()
    no_traceback(r)


# --- configs -----------------------------------------------------------------------------------


def parse(text: str) -> object:
    return parse_config(textwrap.dedent(text).removeprefix("\n"), "/etc/g.yaml")


@pytest.mark.parametrize("value", [".nan", ".NaN", ".inf", "-.inf"])
def test_nan_and_infinities_are_refused_wherever_a_number_is_read(value: str) -> None:
    for text, key in (
        (f"governor:\n  psi_full: {value}\n", "governor.psi_full"),
        (f"hung_grace: {value}\n", "hung_grace"),
        (f"router:\n  daily_budget: {value}\n", "router.daily_budget"),
    ):
        with pytest.raises(ConfigError) as caught:
            parse(text)
        e = caught.value
        assert (e.line, e.key) == (text.count("\n"), key), str(e)
        assert "finite" in e.problem


def test_nan_in_a_text_is_refused_by_the_readers_of_numbers() -> None:
    cfg = parse_config('governor:\n  psi_full: "nan"\n', "/etc/g.yaml")
    with pytest.raises(ConfigError, match="psi_full"):
        governor_config.load(cfg)
    cfg = parse_config('router:\n  daily_budget: "$inf"\n', "/etc/g.yaml")
    with pytest.raises(ConfigError, match="daily_budget"):
        load_table(cfg)


def test_nesting_past_the_limit_names_the_line_where_it_went_past() -> None:
    text = "default_gpu: 0\nrouter:\n  defaults: " + "[" * 5000 + "\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "/etc/g.yaml")
    e = caught.value
    assert e.line == 3 and "nested deeper" in e.problem, str(e)
    block = "routes:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(100))
    with pytest.raises(ConfigError) as caught:
        parse_config(block, "/etc/g.yaml")
    assert caught.value.line is not None and 60 <= caught.value.line <= 70, str(caught.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("backend", "{a: 1}"),
        ("backend", "[llama_cpp]"),
        ("tier", "{a: 1}"),
        ("policy", "[persistent]"),
        ("name", "{a: 1}"),
    ],
)
def test_every_field_of_a_route_candidate_is_type_checked(field: str, value: str) -> None:
    fields = {"backend": "llama_cpp", "model": "/m.gguf", field: value}
    body = ", ".join(f"{k}: {v}" for k, v in fields.items())
    cfg = parse_config(f"routes:\n  t:\n    - {{{body}}}\n", "/etc/g.yaml")
    with pytest.raises(ConfigError) as caught:
        load_table(cfg)
    assert caught.value.key == f"routes.t[0].{field}", str(caught.value)


# --- command lines -----------------------------------------------------------------------------


def test_an_option_given_dashes_as_its_value_is_a_usage_error(cli: Cli) -> None:
    for opt in ("--lease=--", "--timeout=--", "--need=--", "--gpu=--"):
        r = cli.run("run", opt, "--", "true")
        assert_clean_error(r, 2)
        assert opt.split("=")[0] in error_lines(r.stderr)[0], r.describe()


@pytest.mark.parametrize("verbose", [[], ["-v"]], ids=["quiet", "verbose"])
def test_agent_run_shows_a_users_mistake_as_an_error_line(cli: Cli, verbose: list[str]) -> None:
    a_file = cli.root / "out.txt"
    a_file.write_text("")
    for args in (["digest"], ["tagger", str(cli.root), "--out", str(a_file)]):
        r = cli.run("agent", "run", *verbose, *args)
        assert r.code == 1, r.describe()
        no_traceback(r)
        assert len(error_lines(r.stderr)) == 1, r.describe()


# A fixed list, not random: the same cases every run, each a mistake a user or a script makes.
FUZZ: list[tuple[str, ...]] = [
    ("run",),
    ("run", "--"),
    ("run", "--lease=--", "--", "true"),
    ("run", "--gpu", "-1", "--", "true"),
    ("run", "--gpu", "99999999999999999999", "--", "true"),
    ("run", "--need", "1e999GiB", "--", "true"),
    ("run", "--need", "nan", "--", "true"),
    ("run", "--timeout", "inf", "--", "true"),
    ("run", "--lease", "-5", "--", "true"),
    ("run", "--lease", "\u200b", "--", "true"),
    ("run", "--", "/nonexistent/x"),
    ("status", "--gpu", "x"),
    ("status", "--json", "--config", "/nonexistent.yaml"),
    ("break",),
    ("break", "0"),
    ("break", "99999999999999999999999"),
    ("break", "--stale", "--grace", "nan"),
    ("break", "--stale", "--force"),
    ("history", "--since", "1e308"),
    ("history", "--since", "banana"),
    ("heartbeat", "7"),
    ("evict",),
    ("evict", "x", "--timeout", "-1"),
    ("route",),
    ("route", "nope"),
    ("route", "t", "--deadline", "nan"),
    ("governor", "--once", "--config", "/"),
    ("fleet",),
    ("fleet", "/nonexistent.yaml"),
    ("fleet", "/", "--dry-run"),
    ("agent",),
    ("agent", "run"),
    ("agent", "run", "nope"),
    ("agent", "run", "digest", "--timeout", "nan"),
    ("agent", "run", "digest", "--out", "/", "/nonexistent"),
    ("agent", "show", "nope", "--json"),
    ("agent", "list", "--module", "/nonexistent.py"),
    ("report", "--since", "nan"),
    ("nope",),
]


def test_no_command_line_in_the_fuzz_list_gives_a_traceback(cli: Cli) -> None:
    started(cli)
    for args in FUZZ:
        r = cli.run(*args)
        no_traceback(r)
        assert r.code in (0, 1, 2, 75, 126, 127), r.describe()
        said = error_lines(r.stderr) or r.stderr.startswith("usage:")  # bare 'agent': help
        if "--json" in args and not said:  # with --json, the error is JSON on stdout
            said = "error" in json.loads(r.stdout)
        assert r.code == 0 or said, r.describe()
