"""The error tree travels between processes; the event log appends, rotates, and skips junk."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import gpulock
from gpulock.core import errors, events


@pytest.mark.parametrize(
    "exc",
    [
        gpulock.LockTimeout(0, 30.0, 4711, "digest", queue_ahead=2),
        gpulock.LockTimeout(1, 0.5),
        gpulock.NeedTooLarge(0, 30 * 2**30, 20 * 2**30),
        gpulock.NotPermitted(12, 1000),
        gpulock.ConfigError("expected one of report, kill", file="g.yaml", line=4, key="on_hung"),
        gpulock.StateDirError("/tmp/x", "is a symlink", hint="use a real folder"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_fields(exc: errors.GpulockError) -> None:
    back = pickle.loads(pickle.dumps(exc))  # noqa: S301 - our own bytes, just made
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.__dict__ == exc.__dict__
    assert back.hint == exc.hint
    assert getattr(back, "__notes__", []) == ([f"hint: {exc.hint}"] if exc.hint else [])


def test_an_uncaught_error_shows_its_hint_and_the_known_names(tmp_path: Path) -> None:
    # A library user who does not catch UnknownTask saw only "unknown task 'summarise'".
    cfg = tmp_path / "gpulock.yaml"
    cfg.write_text(
        "routes:\n"
        "  summarize: [{tier: cloud, backend: openai, model: m, base_url: http://127.0.0.1:9/v1,"
        " api_key_env: K}]\n"
        "  tag: [{tier: cloud, backend: openai, model: m, base_url: http://127.0.0.1:9/v1,"
        " api_key_env: K}]\n"
    )
    env = {**os.environ, "GPULOCK_CONFIG": str(cfg), "GPULOCK_STATE_DIR": str(tmp_path / "s")}
    code = "from gpulock import router; router.get_model('summarise')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    tail = r.stderr.splitlines()[-2:]
    assert tail == [
        "gpulock.router.errors.UnknownTask: unknown task 'summarise'",
        "hint: did you mean 'summarize'? known tasks: summarize, tag",
    ]


def test_the_hint_survives_a_process_boundary_in_the_traceback() -> None:
    exc = pickle.loads(pickle.dumps(gpulock.NeedTooLarge(0, 2**40, 2**30)))  # noqa: S301
    text = "".join(traceback.format_exception(exc))
    assert text.endswith("hint: ask for less, or lower 'reserve' in the config\n")


def test_lock_timeout_is_a_timeout_error_that_names_the_holder() -> None:
    exc = gpulock.LockTimeout(0, 30.0, 4711, "digest")
    assert isinstance(exc, TimeoutError)
    assert isinstance(exc, gpulock.LockError)
    assert str(exc) == "gpu0 busy after 30.0 s (held by pid 4711, 'digest')"
    assert (exc.gpu, exc.waited_s, exc.holder_pid, exc.holder_name) == (0, 30.0, 4711, "digest")


def _raise_timeout() -> None:
    raise gpulock.LockTimeout(0, 1.5, 99, "tts")


def test_lock_timeout_crosses_a_process_boundary() -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        result = pool.apply_async(_raise_timeout)
        with pytest.raises(gpulock.LockTimeout) as info:
            result.get(timeout=60)
    assert (info.value.holder_pid, info.value.holder_name, info.value.waited_s) == (99, "tts", 1.5)


def test_config_error_reads_file_line_key() -> None:
    exc = gpulock.ConfigError("expected a whole number", file="g.yaml", line=3, key="default_gpu")
    assert str(exc) == "g.yaml:3: default_gpu: expected a whole number"


def test_events_append_one_json_line_each(tmp_path: Path) -> None:
    events.emit(tmp_path, "acquire", gpu=0, ticket=1, waited_s=0.25)
    events.emit(tmp_path, "release", gpu=0, ticket=1, held_s=3.0)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["acquire", "release"]
    got = list(events.read(tmp_path))
    assert got[0]["waited_s"] == 0.25 and got[1]["held_s"] == 3.0
    assert all(isinstance(e["ts"], float) for e in got)


def test_events_rotate_past_max_bytes_keeping_one_generation(tmp_path: Path) -> None:
    for i in range(200):
        events.emit(tmp_path, "wait", max_bytes=2000, ticket=i, pad="x" * 40)
    current = tmp_path / "events.jsonl"
    rotated = tmp_path / "events.jsonl.1"
    assert rotated.exists()
    events.emit(tmp_path, "wait", max_bytes=2000, ticket=200, pad="x" * 40)
    assert current.stat().st_size <= 2000 + 200  # at most one line past the limit
    assert rotated.stat().st_size <= 2000 + 200
    tickets = [e["ticket"] for e in events.read(tmp_path)]
    assert tickets == sorted(tickets)  # the old generation is read first
    assert tickets[-1] == 200


def test_events_reader_skips_junk_and_since_filters(tmp_path: Path) -> None:
    events.emit(tmp_path, "acquire", now_wall=100.0, ticket=1)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('not json\n[1, 2]\n{"event": 3, "ts": 1}\n{"event": "x"}\n\n')
    events.emit(tmp_path, "release", now_wall=200.0, ticket=1)
    assert [e["event"] for e in events.read(tmp_path)] == ["acquire", "release"]
    assert [e["event"] for e in events.read(tmp_path, since_wall=150.0)] == ["release"]


def test_emit_never_raises_when_the_folder_is_gone(tmp_path: Path) -> None:
    events.emit(tmp_path / "missing", "acquire", ticket=1)  # no exception: the lock goes on


def test_a_fifo_in_place_of_the_event_log_never_hangs_a_writer_or_a_reader(
    tmp_path: Path,
) -> None:
    # Every acquire and release writes an event: a FIFO put where events.jsonl should be would
    # have held every holder in open() for ever (no reader ever comes).
    import subprocess
    import sys

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / "events.jsonl")
    code = (
        "import pathlib, sys; from gpulock.core import events; "
        "p = pathlib.Path(sys.argv[1]); events.emit(p, 'acquire', gpu=0); "
        "print(len(list(events.read(p))))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(state)], capture_output=True, text=True, timeout=20
    )
    assert (r.returncode, r.stdout.strip()) == (0, "0"), r.stderr


def _emitted_kinds() -> dict[str, str]:
    """Every event kind the source writes: the literal first argument of each ``.emit(...)``
    (both sides of an ``a if up else b``) and of the pool's ``_emit``, with where it is."""
    import ast

    root = Path(gpulock.__file__).parent
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("emit", "_emit") or not node.args:
                continue
            first = node.args[0]
            choices = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
            for c in choices:
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    found[c.value] = f"{path.relative_to(root.parent)}:{node.lineno}"
    return found


def test_every_event_kind_written_is_in_the_catalogue() -> None:
    found = _emitted_kinds()
    assert len(found) > 30, found  # the scan sees the source at all
    missing = {k: where for k, where in found.items() if k not in events.KINDS}
    assert missing == {}, f"add these to gpulock.core.events.KINDS: {missing}"
    unused = set(events.KINDS) - set(found)
    assert unused == set(), f"in KINDS but never written: {unused}"
