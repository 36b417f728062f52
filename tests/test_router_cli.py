"""``gpulock route TASK [--explain] [--json] [--deadline] [--prefer]`` and the ``usage`` part of
``gpulock status``, driven as a user does: the real command in a fresh interpreter.

Exit codes: 0 a candidate fits, 75 none fits now, 2 unknown task (the known ones listed) or a
bad option, 1 a config error naming file, line and key; never a traceback.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_helpers import GPULOCK, Cli, assert_clean_error, wait_until

from gpulock.core import gguf as gguf_info
from gpulock.core.units import format_size
from gpulock.router.tiny_model import ensure_tiny_llama

VERDICT_KEYS = {
    "key",
    "name",
    "tier",
    "backend",
    "model",
    "policy",
    "n_ctx",
    "ok",
    "chosen",
    "reason",
    "gpu",
    "gpus",  # the GPUs its ticket would wait for (a set for a local model without gpu:)
    "need_bytes",
    "warm",
    "tools",  # {"ok", "how"}: whether it can call tools (gpulock.router.tools)
    "reservation",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


def configure(cli: Cli, text: str) -> Path:
    path = cli.root / "gpulock.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def routes(cli: Cli, tiny: Path, extra: str = "") -> Path:
    return configure(
        cli,
        f"""
        {extra}
        routes:
          summarize:
            - tier: gpu
              backend: llama_cpp
              model: {tiny}
              n_ctx: 256
            - tier: cpu
              backend: llama_cpp
              model: {tiny}
          digest:
            inherit: summarize
            n_ctx: 128
          remote:
            - backend: openai
              model: gpt-4o-mini
              base_url: https://api.example/v1
              api_key_env: GPULOCK_TEST_UNSET_KEY
        """,
    )


def need(tiny: Path, n_ctx: int) -> int:
    return gguf_info.estimate_vram(gguf_info.read_info(str(tiny)), n_ctx=n_ctx, n_gpu_layers=-1)


def test_route_names_the_choice_in_one_line(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "summarize", "--config", str(cfg))
    assert r.code == 0, r.describe()
    size = format_size(need(tiny, 256))
    assert r.stdout == f"summarize: gpu tiny-llama (routes.summarize[0]): gpu0: needs {size}\n"
    assert r.stderr == ""


def test_explain_gives_every_candidate(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "digest", "--explain", "--config", str(cfg))
    assert r.code == 0, r.describe()
    size = format_size(need(tiny, 128))
    assert r.stdout.splitlines() == [
        f"digest: gpu tiny-llama (routes.summarize[0]): gpu0: needs {size}",
        "  passed over: cpu tiny-llama (routes.summarize[1]): runs on the CPU",
        "tools: cannot: tiny-llama (a chat template that is not ChatML; name a handler in "
        "tools: if the model follows one)",
    ]


def test_json_is_the_documented_object(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "summarize", "--json", "--config", str(cfg))
    assert r.code == 0, r.describe()
    data = r.json()
    assert set(data) == {"task", "level", "host", "chosen", "candidates"}
    assert (data["task"], data["level"]) == ("summarize", "normal")
    assert isinstance(data["host"], str) and data["host"]  # this host's (no cluster: the hostname)
    assert all(set(v) == VERDICT_KEYS for v in data["candidates"])
    gpu, cpu = data["candidates"]
    assert data["chosen"] == gpu
    assert (gpu["tier"], gpu["chosen"], gpu["gpu"], gpu["need_bytes"]) == (
        "gpu",
        True,
        0,
        need(tiny, 256),
    )
    assert (gpu["backend"], gpu["model"], gpu["policy"], gpu["n_ctx"]) == (
        "llama_cpp",
        str(tiny),
        "persistent",
        256,
    )
    assert (cpu["tier"], cpu["ok"], cpu["chosen"], cpu["gpu"], cpu["reason"]) == (
        "cpu",
        True,
        False,
        None,
        "runs on the CPU",
    )


def test_prefer_and_no_gpu(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "summarize", "--prefer", "cpu", "--config", str(cfg))
    assert r.code == 0 and r.stdout.startswith("summarize: cpu tiny-llama"), r.describe()
    bare = Cli(cli.root, simulate=None)  # no GPULOCK_SIMULATE and no NVML here: no GPU
    r = bare.run("route", "summarize", "--explain", "--config", str(cfg))
    if r.code == 0 and "rejected: gpu tiny-llama" not in r.stdout:
        pytest.skip("this machine has a real GPU")
    assert (
        r.stdout.splitlines()[0]
        == "summarize: cpu tiny-llama (routes.summarize[1]): runs on the CPU"
    )
    assert "  rejected: gpu tiny-llama (routes.summarize[0]): no GPU" in r.stdout


def test_deadline_against_a_real_holder(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny, extra="router: {hold_estimate: 30s}")
    env = cli.env(GPULOCK_CONFIG=str(cfg))
    holder = cli.hold("holder")  # a real `gpulock run` holding gpu0 until released
    r = cli.run("route", "summarize", "--explain", "--deadline", "5s", env=env)
    assert r.code == 0, r.describe()
    first, second = r.stdout.splitlines()[:2]
    assert first == "summarize: cpu tiny-llama (routes.summarize[1]): runs on the CPU"
    assert second.startswith("  rejected: gpu tiny-llama (routes.summarize[0]): gpu0 queue: ~")
    assert second.endswith("wait (1 ahead) > deadline 5.0 s")
    r = cli.run("route", "summarize", "--deadline", "2m", env=env)
    assert r.stdout.startswith("summarize: gpu tiny-llama") and "queue wait" in r.stdout
    holder.release()
    holder.wait()


def test_a_holder_with_a_need_that_leaves_room_is_no_queue(cli: Cli, tiny: Path) -> None:
    # gpulock shares the GPU between needs that fit: a deadline must not send the work away
    cfg = routes(cli, tiny, extra="router: {hold_estimate: 30s}")
    env = cli.env(GPULOCK_CONFIG=str(cfg))
    holder = cli.hold("holder", "--need", "1GiB")
    r = cli.run("route", "summarize", "--deadline", "5s", env=env)
    assert r.code == 0, r.describe()
    assert r.stdout == (
        f"summarize: gpu tiny-llama (routes.summarize[0]): gpu0: needs "
        f"{format_size(need(tiny, 256))}, shared with 1 holder\n"
    )
    holder.release()
    holder.wait()


def test_nothing_fits_exits_75_and_says_why(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "remote", "--config", str(cfg))
    assert r.code == 75, r.describe()
    assert r.stdout.splitlines() == [
        "remote: no candidate fits",
        "  rejected: cloud gpt-4o-mini (routes.remote[0]): environment variable "
        "GPULOCK_TEST_UNSET_KEY is not set (routes.remote[0].api_key_env)",
    ]
    assert "Traceback" not in r.stderr
    r = cli.run("route", "remote", "--json", "--config", str(cfg))
    assert r.code == 75 and r.json()["chosen"] is None


def test_a_missing_model_file_exits_75_naming_its_key(cli: Cli) -> None:
    cfg = configure(cli, "routes:\n  t:\n    - {backend: llama_cpp, model: models/gone.gguf}\n")
    r = cli.run("route", "t", "--config", str(cfg))
    assert r.code == 75, r.describe()
    gone = cli.root / "models" / "gone.gguf"  # relative to the config file's folder
    assert f"model file not found: {gone} (routes.t[0].model)" in r.stdout


def test_an_unknown_task_lists_the_known_ones(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "sumarize", "--config", str(cfg))
    assert_clean_error(r, 2)
    assert "error: unknown task 'sumarize'" in r.stderr
    assert "hint: did you mean 'summarize'? known tasks: digest, remote, summarize" in r.stderr


def test_a_preference_that_names_nothing_is_an_error(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "summarize", "--prefer", "gpuu", "--config", str(cfg))
    assert_clean_error(r, 2)
    assert "error: prefer='gpuu' is neither a tier nor a model of task 'summarize'" in r.stderr
    assert "hint: tiers: cpu, gpu, cloud; models of summarize: tiny-llama" in r.stderr
    # a tier the task lacks is no mistake: the next best is taken
    r = cli.run("route", "summarize", "--prefer", "cloud", "--config", str(cfg))
    assert r.code == 0, r.describe()


def test_no_routes_at_all(cli: Cli) -> None:
    cfg = configure(cli, "reserve: 1GiB\n")
    r = cli.run("route", "--config", str(cfg))
    assert r.code == 0 and r.stdout.startswith("no routes: add a routes: section"), r.describe()
    r = cli.run("route", "summarize", "--config", str(cfg))
    assert_clean_error(r, 2)
    assert f"hint: add a routes: section to {cfg}" in r.stderr


def test_without_a_task_the_tasks_are_listed(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "--config", str(cfg))
    assert r.code == 0, r.describe()
    assert r.stdout.splitlines() == [
        "digest: gpu tiny-llama, cpu tiny-llama",
        "remote: cloud gpt-4o-mini",
        "summarize: gpu tiny-llama, cpu tiny-llama",
    ]
    data = cli.run("route", "--json", "--config", str(cfg)).json()
    assert sorted(data) == ["digest", "remote", "summarize"]
    assert data["remote"] == [
        {"key": "routes.remote[0]", "tier": "cloud", "name": "gpt-4o-mini", "model": "gpt-4o-mini"}
    ]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "routes:\n  t:\n    - {backend: llama_cpp, model: m.gguf, n_ctxx: 5}\n",
            ":3: routes.t[0].n_ctxx: unknown key",
        ),
        (
            "routes:\n  t:\n    - backend: openai\n      model: x\n",
            ":3: routes.t[0].base_url: an openai",
        ),
        ("router:\n  cooldown: soon\n", ":2: router.cooldown: "),
    ],
)
def test_a_config_error_exits_1_naming_file_line_and_key(cli: Cli, text: str, where: str) -> None:
    cfg = configure(cli, text)
    r = cli.run("route", "t", "--config", str(cfg))
    assert_clean_error(r, 1)
    assert f"error: {cfg}{where}" in r.stderr


def test_bad_options_are_usage_errors(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    r = cli.run("route", "summarize", "--deadline", "soon", "--config", str(cfg))
    assert r.code == 2 and "Traceback" not in r.stderr, r.describe()
    assert "--deadline" in r.stderr


def test_route_loads_nothing_and_records_nothing(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny)
    for args in (("summarize",), ("summarize", "--json"), ("remote",), ()):
        cli.run("route", *args, "--config", str(cfg))
    assert cli.events() == []
    assert not (cli.state / "gpu0").exists() and not (cli.state / "residents").exists()


# --- garbage in the state folder and in model files ---------------------------------------------

CUT_S = 10.0  # a command still running after this hangs: before the fix, for ever


@pytest.mark.parametrize(
    "ledger",
    [
        pytest.param("[" * 100_000, id="nested-past-the-parser"),
        pytest.param(
            json.dumps(
                {
                    "format": "gpulock.ledger/1",
                    "day": time.strftime("%Y-%m-%d"),
                    "usage": {"agent": {"a": {"calls": "many"}}},
                }
            ),
            id="text-for-a-number",
        ),
    ],
)
def test_route_reads_past_a_damaged_ledger(cli: Cli, tiny: Path, ledger: str) -> None:
    cfg = routes(cli, tiny)
    (cli.state / "router").mkdir(mode=0o700, parents=True)
    (cli.state / "router" / "ledger.json").write_text(ledger)
    r = cli.run("route", "summarize", "--config", str(cfg), timeout_s=CUT_S)
    assert r.code == 0 and "Traceback" not in r.stderr, r.describe()
    assert r.stdout.startswith("summarize: gpu tiny-llama")


def test_route_does_not_wait_on_a_fifo_in_place_of_the_event_log(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny, extra="router: {hold_estimate: 30s}")
    holder = cli.hold("holder")  # a queue, so the probe reads recent holds from the log
    log = cli.state / "events.jsonl"
    log.unlink()
    os.mkfifo(log, 0o600)
    argv = [*GPULOCK, "route", "summarize", "--config", str(cfg)]
    try:
        # Not cli.run: on a timeout it describes the state folder, reading the FIFO itself.
        r = subprocess.run(argv, env=cli.env(), capture_output=True, text=True, timeout=CUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"gpulock route still waiting after {CUT_S:g} s") from None
    finally:
        log.unlink()  # the holder's release appends to it
    assert r.returncode == 0, r.stderr
    assert "queue wait" in r.stdout  # no history: the configured hold estimate stands in
    holder.release()
    holder.wait()


def test_impossible_hold_times_in_the_log_are_not_history(cli: Cli, tiny: Path) -> None:
    cfg = routes(cli, tiny, extra="router: {hold_estimate: 30s}")
    env = cli.env(GPULOCK_CONFIG=str(cfg))
    holder = cli.hold("holder")
    lines = [f'{{"ts": 1, "event": "release", "gpu": 0, "held_s": {h}}}' for h in ("NaN", -50)]
    with open(cli.state / "events.jsonl", "a") as f:
        f.write("\n".join(["[" * 5000 + '"release"', *lines]) + "\n")
    # Taken for history, they made the wait ~0 ms; the hold estimate makes it ~30 s.
    r = cli.run("route", "summarize", "--explain", "--deadline", "5s", env=env)
    assert r.code == 0, r.describe()
    assert r.stdout.startswith("summarize: cpu tiny-llama"), r.describe()
    assert "> deadline 5.0 s" in r.stdout
    holder.release()
    holder.wait()


def test_the_wait_is_estimated_from_who_is_in_line(cli: Cli, tiny: Path) -> None:
    # The repro: a long exclusive holder and two waiters whose names took seconds
    # before, with quick jobs of other names filling the recent history.  The GPU-wide median
    # said "~112 ms"; each name's own holds say ~11 s, past a 5 s deadline.
    cfg = routes(cli, tiny, extra="router: {hold_estimate: 30s}")
    env = cli.env(GPULOCK_CONFIG=str(cfg))
    history = [("render", 6.0), ("render", 6.2), ("tts", 3.0), ("tts", 3.1)]
    history += [("tagger", 0.05)] * 20
    holder = cli.hold("render")  # creates the state folder
    with open(cli.state / "events.jsonl", "a") as f:
        for name, held in history:
            f.write(
                json.dumps({"ts": 1, "event": "release", "gpu": 0, "name": name, "held_s": held})
            )
            f.write("\n")
    waiters = [cli.start_run("tts", cmd=["true"]) for _ in range(2)]
    wait_until(lambda: len(cli.entries()) == 3, lambda: f"3 in line\n{cli.describe()}")
    r = cli.run("route", "summarize", "--explain", "--deadline", "5s", env=env)
    assert r.code == 0, r.describe()
    assert r.stdout.startswith("summarize: cpu tiny-llama"), r.describe()
    assert "(3 ahead) > deadline 5.0 s" in r.stdout
    holder.release()
    for p in [holder, *waiters]:
        p.wait()


def gguf(*parts: bytes) -> bytes:
    """A GGUF v3 header with no tensors and one key/value: ``parts`` after the key's name."""
    key = b"k"
    return b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + b"".join(parts)


DAMAGED_GGUF = {
    # an array of 2**63 bytes: seeking past it overflowed
    "huge-array": gguf(struct.pack("<IIQ", 9, 0, 2**63)),
    # an array of one string of 2**63 bytes: the same
    "huge-string": gguf(struct.pack("<IIQQ", 9, 8, 1, 2**63)),
    # arrays of arrays 5000 deep: the recursion ran out
    "nested": gguf(struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000),
    "not-gguf": b"hello\n",
}


@pytest.mark.parametrize("name", DAMAGED_GGUF)
def test_a_damaged_model_file_is_no_traceback(cli: Cli, name: str) -> None:
    model = cli.root / f"{name}.gguf"
    model.write_bytes(DAMAGED_GGUF[name])
    with pytest.raises(gguf_info.GGUFError):
        gguf_info.read_info(str(model))
    cfg = configure(
        cli, f"routes:\n  t:\n    - {{tier: gpu, backend: llama_cpp, model: {model}}}\n"
    )
    r = cli.run("route", "t", "--config", str(cfg), timeout_s=CUT_S)
    assert r.code == 0 and "Traceback" not in r.stderr, r.describe()
    assert "needs the whole GPU" in r.stdout  # no estimate: the lock would ask for all of it


def test_a_fifo_named_as_the_model_is_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = (
        "import sys\nfrom gpulock.core import gguf as gguf_info\n"
        "try:\n    gguf_info.read_info(sys.argv[1])\n"
        "except gguf_info.GGUFError as e:\n    print(e)\n"
    )
    try:  # in a child: in this process a regression would hang the whole test run
        r = subprocess.run(
            [sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=CUT_S
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"read_info still waiting after {CUT_S:g} s") from None
    assert r.stdout == f"{fifo}: not a regular file, so not a GGUF model\n", r.stderr


# --- gpulock status: today's usage ----------------------------------------------------------------


def test_status_shows_todays_usage(cli: Cli, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    from gpulock import router

    cfg = routes(cli, tiny, extra="router: {daily_budget: 2.5}")
    cli.state.mkdir(mode=0o700)
    assert cli.status()["usage"] is None  # the router was never used
    monkeypatch.setenv("GPULOCK_SIMULATE", "24GiB")
    for agent in ("alpha", "beta", "beta"):
        m = router.get_model(
            "summarize", prefer="cpu", agent=agent, config=str(cfg), state_dir=str(cli.state)
        )
        m.complete("hello", max_tokens=3)
    env = cli.env(GPULOCK_CONFIG=str(cfg))
    r = cli.run("status", "--json", env=env)
    assert r.code == 0, r.describe()
    usage = r.json()["usage"]
    assert set(usage) == {
        "day",
        "cloud_spend_usd",
        "daily_budget_usd",
        "by_agent",
        "by_task",
        "by_tier",
    }
    assert (usage["cloud_spend_usd"], usage["daily_budget_usd"]) == (0.0, 2.5)
    assert usage["by_agent"]["beta"] == {
        "calls": 2,
        "tokens_in": 14,
        "tokens_out": 6,
        "cost_usd": 0,
    }
    assert usage["by_tier"] == {
        "cpu": {"calls": 3, "tokens_in": 21, "tokens_out": 9, "cost_usd": 0}
    }
    assert usage["by_task"]["summarize"]["calls"] == 3
    row = usage["by_agent"]["alpha"]
    assert [type(row[k]) for k in ("calls", "tokens_in", "tokens_out", "cost_usd")] == [
        int,
        int,
        int,
        float,
    ]
    text = cli.run("status", env=env).stdout
    assert "model calls today: cpu 3; cloud spend $0.0000 of $2.50" in text
    assert "  beta: 2 calls, 14+6 tokens, $0.0000" in text
    assert "  alpha: 1 call, 7+3 tokens, $0.0000" in text
    m.unload()
