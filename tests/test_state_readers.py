"""Commands that only read the state folder never create it: a mistyped ``--state-dir`` or
``$GPULOCK_STATE_DIR`` is an error naming the folder, not an empty world in a new folder.
The commands that write (``run``...) still create it."""

from __future__ import annotations

import pytest
from cli_helpers import Cli, assert_clean_error, error_lines

READERS = [
    ["status"],
    ["status", "--json"],
    ["history"],
    ["history", "--json"],
    ["break", "--stale"],
    ["heartbeat", "1"],
    ["report", "--json"],
    ["replay", "--gpu", "24GiB"],
    ["metrics"],
]


@pytest.mark.parametrize("args", READERS, ids=lambda a: "-".join(a))
def test_a_reader_refuses_a_state_folder_that_does_not_exist(cli: Cli, args: list[str]) -> None:
    typo = cli.root / "stat-dir" / "gpulock"
    r = cli.run(*args, "--state-dir", str(typo))
    if "--json" in args:
        assert r.code == 1 and r.stderr == "", r.describe()
        err = r.json()["error"]
        assert err["message"] == f"state folder {typo} does not exist", r.describe()
        assert "--state-dir" in err["hint"], r.describe()
    elif args[0] == "metrics" and r.code == 1 and "prometheus" in r.stderr:
        pytest.skip("needs the metrics extra (prometheus_client)")
    else:
        assert_clean_error(r, 1)
        [line] = error_lines(r.stderr)
        assert line == f"error: state folder {typo} does not exist", r.describe()
        assert "hint: check --state-dir" in r.stderr, r.describe()
    assert not typo.parent.exists()


def test_a_reader_names_the_variable_the_folder_came_from(cli: Cli) -> None:
    typo = cli.root / "nowhere"
    r = cli.run("status", env=cli.env(GPULOCK_STATE_DIR=str(typo)))
    assert_clean_error(r, 1)
    assert f"error: state folder {typo} does not exist" in r.stderr, r.describe()
    assert "hint: check $GPULOCK_STATE_DIR" in r.stderr, r.describe()
    assert not typo.exists()


def test_a_reader_names_the_config_key_the_folder_came_from(cli: Cli) -> None:
    typo = cli.root / "nowhere"
    config = cli.root / "gpulock.yaml"
    config.write_text(f"state_dir: {typo}\n")
    r = cli.run("history", env=cli.env(GPULOCK_STATE_DIR=None, GPULOCK_CONFIG=str(config)))
    assert_clean_error(r, 1)
    assert f"hint: check 'state_dir' in {config}" in r.stderr, r.describe()
    assert not typo.exists()


def test_a_writer_still_creates_it_and_then_the_readers_read_it(cli: Cli) -> None:
    assert not cli.state.exists()
    assert cli.run("run", "--name", "first", "--", "true").code == 0
    assert cli.state.is_dir()
    r = cli.run("history")
    assert r.code == 0 and "first" in r.stdout, r.describe()


def test_tmp_as_the_state_folder_is_advised_a_private_subfolder(cli: Cli) -> None:
    for args in (["status"], ["run", "--", "true"]):
        r = cli.run(args[0], "--state-dir", "/tmp", *args[1:])
        assert_clean_error(r, 1)
        assert "world-writable" in r.stderr, r.describe()
        assert "chmod" not in r.stderr, r.describe()
        assert "mkdir -m 700 /tmp/gpulock-$USER" in r.stderr, r.describe()
