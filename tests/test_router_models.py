"""router.get_model with real llama.cpp: the tiny GGUF model on the CPU, and the gpu tier on a
simulated GPU (``simulate: 24GiB``).

On this machine llama.cpp runs on the CPU either way, but everything gpulock does around a
gpu-tier call is real: the lock taken with ``need`` = the GGUF estimate (``acquire`` events),
the resident record while a ``persistent`` model stays loaded (and its eviction by another
process), none after a ``cold-start`` call, the governor's published level, other processes
holding the GPU, and the ``call`` events and ledger that count tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import World

from gpulock import router
from gpulock.core import claim, level
from gpulock.core import gguf as gguf_info
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.units import calendar_day
from gpulock.residents import registry
from gpulock.router import ledger
from gpulock.router.choose import cid
from gpulock.router.tiny_model import ensure_tiny_llama

pytest.importorskip("llama_cpp")

AGENT = "tester"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def unload_models() -> Iterator[None]:
    """Models stay loaded in this process between calls (that is the point of persistent):
    unload what each test loaded, so that none is warm in the next test."""
    yield
    from gpulock.router.backends import llama_cpp

    for b in list(llama_cpp._cache.values()):
        b.unload()
    llama_cpp._cache.clear()


def configure(world: World, routes: str, extra: str = "") -> Settings:
    world.config.write_text(
        "simulate: 24GiB\n"
        + textwrap.dedent(extra)
        + "routes:\n"
        + textwrap.indent(textwrap.dedent(routes), "  ")
    )
    return world.settings()


def estimate(tiny: Path, n_ctx: int) -> int:
    return gguf_info.estimate_vram(gguf_info.read_info(str(tiny)), n_ctx=n_ctx, n_gpu_layers=-1)


def records(s: Settings) -> list[registry.Record]:
    return registry.Registry(s).records()


def used_bytes(s: Settings) -> int | None:
    dev = registry.probe_devices(s).get(0)
    return None if dev is None else dev.used_bytes


def printable(text: str) -> bool:
    return all(" " <= ch <= "~" for ch in text)


def gpu_and_cpu(
    tiny: Path, policy: str = "persistent", n_ctx: int = 256, cpu_ctx: int = 256
) -> str:
    return f"""
    t:
      - tier: gpu
        backend: llama_cpp
        model: {tiny}
        n_ctx: {n_ctx}
        policy: {policy}
      - tier: cpu
        backend: llama_cpp
        model: {tiny}
        n_ctx: {cpu_ctx}
    """


# --- the cpu tier -------------------------------------------------------------------------------


def test_cpu_tier_generates_counts_tokens_and_takes_no_lock(world: World, tiny: Path) -> None:
    s = configure(world, f"t:\n  - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256}}\n")
    m = router.get_model("t", agent=AGENT)
    assert (m.tier, m.name) == ("cpu", "tiny-llama")
    assert m.why == "t: cpu tiny-llama (routes.t[0]): runs on the CPU"
    text = m.complete("hello", max_tokens=8)
    assert printable(text) and 0 < len(text) <= 8
    reply = m.chat([{"role": "user", "content": "hi"}], max_tokens=5)
    assert printable(reply) and 0 < len(reply) <= 5
    pieces = list(m.complete("hello", max_tokens=6, stream=True))
    assert len(pieces) == 6 and printable("".join(pieces))
    calls = world.events("call", task="t")
    assert [(c["tier"], c["ok"], c["agent"]) for c in calls] == [("cpu", True, AGENT)] * 3
    # "hello" is <s> + "▁" + 5 byte tokens; the tiny model always generates max_tokens tokens;
    # the chat prompt is the template's "<s>user: hi\nassistant:", one token a byte
    assert [(c["tokens_in"], c["tokens_out"]) for c in calls] == [(7, 8), (21, 5), (7, 6)]
    assert all(c["latency_s"] > 0 and c["cost_usd"] == 0 and c["gpu"] is None for c in calls)
    route = world.events("route", task="t")
    assert [(r["tier"], r["model"], r["agent"]) for r in route] == [("cpu", "tiny-llama", AGENT)]
    assert world.events("acquire") == [] and not world.gpu_dir().exists()
    assert records(s) == []
    usage = ledger.read(s).usage
    assert usage["tier"]["cpu"]["calls"] == 3
    assert usage["agent"][AGENT]["tokens_out"] == 8 + 5 + 6
    (loaded,) = world.events("model-load")  # persistent: loaded once, kept
    assert loaded["path"] == str(tiny)  # the file pre-warming reads into the page cache


def test_streamed_usage_is_the_unstreamed_usage(world: World, tiny: Path) -> None:
    """The tokens the model processed and generated, the same streamed or not: the chat
    template's prompt (21 tokens, not the 4 of the message text), and tokens, not pieces."""
    configure(world, f"t:\n  - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256}}\n")
    m = router.get_model("t", agent=AGENT)
    chat = [{"role": "user", "content": "hi"}]
    m.chat(chat, max_tokens=5)
    "".join(m.chat(chat, max_tokens=5, stream=True))
    m.complete("hello there", max_tokens=7)
    "".join(m.complete("hello there", max_tokens=7, stream=True))
    pieces = m.chat(chat, max_tokens=9, stream=True)
    next(pieces)
    pieces.close()  # a stream stopped early is counted with what it got
    calls = [(c["tokens_in"], c["tokens_out"]) for c in world.events("call", task="t")]
    assert calls[0] == calls[1] == (21, 5), calls
    assert calls[2] == calls[3] and calls[2][1] == 7, calls
    assert calls[4][0] == 21 and 1 <= calls[4][1] < 9, calls


def test_cpu_cold_start_loads_every_call(
    world: World, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPULOCK_AGENT", "nightly-digest")  # set by the agent runtime
    configure(
        world,
        f"t:\n  - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, "
        "policy: cold-start}\n",
    )
    for _ in range(2):
        router.get_model("t").complete("x", max_tokens=2)
    assert len(world.events("model-load")) == 2
    assert world.events("acquire") == []
    assert {e["agent"] for e in world.events("call")} == {"nightly-digest"}


# --- the gpu tier: the lock and the resident ---------------------------------------------------


def test_gpu_persistent_takes_the_lock_with_the_estimate_and_stays_resident(
    world: World, tiny: Path
) -> None:
    s = configure(world, gpu_and_cpu(tiny))
    need = estimate(tiny, 256)
    m = router.get_model("t", agent=AGENT)
    assert (m.tier, m.gpu, m.choice.chosen and m.choice.chosen.need_bytes) == ("gpu", 0, need)
    text = m.complete("hello", max_tokens=4)
    assert printable(text)

    (acq,) = world.events("acquire")
    assert (acq["gpu"], acq["need_bytes"], acq["name"]) == (0, need, f"{AGENT}:t")
    (load,) = world.events("model-load")
    (rel,) = world.events("release")
    (call,) = world.events("call")
    assert acq["ts"] <= load["ts"] <= rel["ts"] <= call["ts"]  # loaded under the lock
    assert (load["need_bytes"], load["n_ctx"], load["tier"]) == (need, 256, "gpu")
    assert (call["gpu"], call["tokens_in"], call["tokens_out"]) == (0, 7, 4)

    (rec,) = records(s)  # still loaded, registered: others can see it and ask for it back
    assert (rec.name, rec.policy, rec.declared_bytes, rec.in_use, rec.uses) == (
        "tiny-llama",
        "persistent",
        need,
        False,
        1,
    )
    assert rec.pid == os.getpid()
    assert used_bytes(s) == need

    again = router.get_model("t", agent=AGENT)
    assert again.why.splitlines()[0] == "t: gpu tiny-llama (routes.t[0]): gpu0: needs " + (
        f"{need / 1024**2:.1f} MiB (warm)"
    )
    again.chat([{"role": "user", "content": "hi"}], max_tokens=3)
    assert len(world.events("model-load")) == 1  # warm: not loaded again
    assert len(world.events("acquire")) == 2  # but every call takes the lock
    assert records(s)[0].uses == 2


def test_a_persistent_model_is_evictable_while_idle_and_comes_back(
    world: World, tiny: Path
) -> None:
    s = configure(world, gpu_and_cpu(tiny))
    m = router.get_model("t")
    m.complete("a", max_tokens=2)
    assert len(records(s)) == 1
    # another process asks for the memory back, as the governor or a waiter would
    out = subprocess.run(
        [sys.executable, "-m", "gpulock", "evict", "tiny-llama", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["outcome"] for r in json.loads(out.stdout)["results"]] == ["freed"]
    assert records(s) == [] and used_bytes(s) == 0
    assert "(warm)" not in router.explain("t").explain()  # no longer loaded here
    m.complete("b", max_tokens=2)  # the same handle loads it again, under the lock
    assert len(world.events("model-load")) == 2
    assert len(records(s)) == 1


def test_a_stream_holds_the_lock_and_the_model_until_it_ends(world: World, tiny: Path) -> None:
    s = configure(world, gpu_and_cpu(tiny, policy="cold-start"))
    need = estimate(tiny, 256)
    pieces = router.get_model("t").complete("hello", max_tokens=5, stream=True)
    first = next(pieces)
    (rec,) = records(s)  # mid-answer: loaded, in use, the GPU held with the estimate
    assert (rec.policy, rec.in_use, rec.declared_bytes) == ("cold-start", True, need)
    holders = [e for e in world.snapshot()["gpus"][0]["holders"]]
    assert [(h["pid"], h["need_bytes"]) for h in holders] == [(os.getpid(), need)]
    rest = list(pieces)
    assert len([first, *rest]) == 5
    assert records(s) == [] and world.snapshot()["gpus"][0]["holders"] == []
    (call,) = world.events("call")
    assert (call["tokens_in"], call["tokens_out"], call["tier"]) == (7, 5, "gpu")


def test_a_stream_left_half_read_gives_the_gpu_back_and_is_counted(
    world: World, tiny: Path
) -> None:
    s = configure(world, gpu_and_cpu(tiny, policy="cold-start"))
    pieces = router.get_model("t").complete("hello", max_tokens=8, stream=True)
    got = [next(pieces), next(pieces)]
    assert world.snapshot()["gpus"][0]["holders"] != []
    pieces.close()  # the caller stops reading (a break out of the loop does the same)
    assert world.snapshot()["gpus"][0]["holders"] == [] and records(s) == []
    (call,) = world.events("call")
    assert (call["ok"], call["tokens_out"], call["tier"]) == (True, len(got), "gpu")


def test_a_stream_whose_prompt_overflows_the_context_falls_back(world: World, tiny: Path) -> None:
    # Seen in the demo: at governor level reduce a GPU context is halved, a long prompt no
    # longer fits, and llama.cpp raises at the first piece; that must fall back, not crash.
    configure(world, gpu_and_cpu(tiny, policy="cold-start", cpu_ctx=512))
    m = router.get_model("t")
    pieces = list(m.complete("x" * 300, max_tokens=3, stream=True))
    assert len(pieces) == 3 and m.tier == "cpu"
    assert m.fallbacks == ["tiny-llama: request"]
    assert world.snapshot()["gpus"][0]["holders"] == []
    assert ledger.read(world.settings()).cooldowns == {}  # the next, shorter prompt may fit


def test_gpu_cold_start_loads_and_unloads_every_call(world: World, tiny: Path) -> None:
    s = configure(world, gpu_and_cpu(tiny, policy="cold-start"))
    need = estimate(tiny, 256)
    for n in (1, 2):
        m = router.get_model("t")
        assert m.tier == "gpu"
        m.complete("x", max_tokens=2)
        assert records(s) == []  # nothing left registered...
        assert used_bytes(s) == 0  # ...nor counted on the GPU
        assert len(world.events("model-load")) == n
    assert [e["declared_bytes"] for e in world.events("resident")] == [need, need]
    assert [e["need_bytes"] for e in world.events("acquire")] == [need, need]


def test_a_failed_cold_start_call_still_unloads(world: World, tiny: Path) -> None:
    s = configure(world, gpu_and_cpu(tiny, policy="cold-start", n_ctx=64))
    m = router.get_model("t")
    assert m.tier == "gpu"
    text = m.complete("x" * 100, max_tokens=2)  # more than the gpu candidate's 64 positions
    assert text and m.tier == "cpu"
    assert world.events("call", ok=False)[0]["error"] == "server"
    assert records(s) == [] and used_bytes(s) == 0  # nothing left loaded on the GPU
    assert world.snapshot()["gpus"][0]["holders"] == []


# --- the governor ---------------------------------------------------------------------------------


class StandInGovernor:
    """Holds the governor's claim and publishes a level, as a running governor does."""

    def __init__(self, s: Settings) -> None:
        self.settings = s
        self.fd = claim.create(level.claim_path(s), 0o600)

    def publish(self, lvl: str) -> None:
        now = time.time()
        level.write(self.settings, level.Published(lvl, now, now, 60.0, os.getpid()))

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def governor(world: World) -> Iterator[StandInGovernor]:
    g = StandInGovernor(world.settings())
    try:
        yield g
    finally:
        g.close()


def test_reduce_loads_a_smaller_context_and_asks_for_less(
    world: World, tiny: Path, governor: StandInGovernor
) -> None:
    configure(world, gpu_and_cpu(tiny, n_ctx=1024))
    governor.publish("reduce")
    m = router.get_model("t")
    assert m.tier == "gpu" and m.candidate.n_ctx == 512
    assert "governor level reduce: n_ctx 1024 -> 512" in m.why
    m.complete("x", max_tokens=2)
    (load,) = world.events("model-load")
    assert load["n_ctx"] == 512
    assert world.events("acquire")[0]["need_bytes"] == estimate(tiny, 512) < estimate(tiny, 1024)


def test_reduce_does_not_load_a_second_copy_of_a_warm_model(
    world: World, tiny: Path, governor: StandInGovernor
) -> None:
    s = configure(world, gpu_and_cpu(tiny, n_ctx=1024))
    router.get_model("t").complete("x", max_tokens=2)  # loaded with n_ctx 1024, kept
    governor.publish("reduce")
    m = router.get_model("t")
    assert m.candidate.n_ctx == 512 and "(warm)" in m.why
    m.complete("x", max_tokens=2)
    # the copy in memory serves: a smaller second one would add memory when it is short
    assert len(world.events("model-load")) == 1 and len(records(s)) == 1
    assert used_bytes(s) == estimate(tiny, 1024)
    assert [e["need_bytes"] for e in world.events("acquire")] == [estimate(tiny, 1024)] * 2


def test_a_larger_context_replaces_the_smaller_copy(
    world: World, tiny: Path, governor: StandInGovernor
) -> None:
    s = configure(world, gpu_and_cpu(tiny, n_ctx=1024))
    governor.publish("reduce")
    router.get_model("t").complete("x", max_tokens=2)  # loaded with n_ctx 512
    governor.publish("normal")
    m = router.get_model("t")
    assert m.candidate.n_ctx == 1024
    m.complete("x" * 600, max_tokens=2)  # needs more than 512 positions
    assert [e["n_ctx"] for e in world.events("model-load")] == [512, 1024]
    (rec,) = records(s)  # the smaller copy was unloaded first: one copy registered
    assert rec.declared_bytes == estimate(tiny, 1024) == used_bytes(s)


def test_freeze_sends_the_work_to_the_cpu(
    world: World, tiny: Path, governor: StandInGovernor
) -> None:
    configure(world, gpu_and_cpu(tiny))
    governor.publish("freeze")
    m = router.get_model("t")
    assert m.tier == "cpu"
    assert "rejected: gpu tiny-llama (routes.t[0]): governor level freeze" in m.why
    m.complete("x", max_tokens=2)
    assert world.events("acquire") == []
    governor.publish("normal")
    assert router.get_model("t").tier == "gpu"


# --- other processes on the GPU -------------------------------------------------------------------


def test_a_queue_longer_than_the_deadline_goes_to_the_cpu(world: World, tiny: Path) -> None:
    configure(world, gpu_and_cpu(tiny), extra="router:\n  hold_estimate: 30s\n")
    holder = world.hold("holder")  # a real process holding gpu0, whole
    m = router.get_model("t", deadline=5)
    assert m.tier == "cpu"
    reason = next(v.reason for v in m.choice.verdicts if v.candidate.tier == "gpu")
    assert reason.startswith("gpu0 queue: ~") and reason.endswith("wait (1 ahead) > deadline 5.0 s")
    assert router.get_model("t", deadline=60).tier == "gpu"  # 30 s is within a minute
    holder.release()
    holder.wait_exit()
    assert router.get_model("t", deadline=5).tier == "gpu"


def test_a_busy_gpu_falls_back_at_the_deadline_without_a_cooldown(world: World, tiny: Path) -> None:
    # history says holds are short, so the gpu is chosen; the holder then stays past the deadline
    s = configure(world, gpu_and_cpu(tiny), extra="router:\n  hold_estimate: 100ms\n")
    holder = world.hold("holder")
    m = router.get_model("t", deadline=0.8)
    assert m.tier == "gpu"
    text = m.complete("x", max_tokens=3)
    assert printable(text) and m.tier == "cpu"
    assert m.fallbacks == ["tiny-llama: busy"]
    failed, ok = world.events("call")
    assert (failed["ok"], failed["error"], failed["tier"], failed["cooldown_s"]) == (
        False,
        "busy",
        "gpu",
        None,
    )
    assert (ok["ok"], ok["tier"]) == (True, "cpu")
    (fb,) = world.events("fallback")
    assert (fb["from_tier"], fb["to_tier"], fb["error"]) == ("gpu", "cpu", "busy")
    assert ledger.read(s).cooldowns == {}  # a queue is not the model's fault
    assert world.events("timeout")  # the lock's own record of the wait given up
    holder.release()


# --- failures: load errors, missing files, unknown tasks ------------------------------------------


def test_a_load_error_falls_back_cools_down_and_the_next_get_model_skips_it(
    world: World, tiny: Path
) -> None:
    bad = world.root / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))  # there, but llama.cpp cannot load it
    s = configure(
        world,
        f"""
        t:
          - {{tier: cpu, backend: llama_cpp, model: {bad}, n_ctx: 256, max_tokens: 3}}
          - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 5}}
        """,
        extra="router:\n  cooldown: 1m\n",
    )
    m = router.get_model("t")
    assert m.name == "bad"
    m.complete("x")
    assert m.name == "tiny-llama" and m.fallbacks == ["bad: load"]
    failed, ok = world.events("call")
    assert (failed["model"], failed["error"], failed["cooldown_s"]) == ("bad", "load", 60.0)
    # llama-cpp-python only says "Failed to load model"; llama.cpp's own log says why.
    assert "Failed to load model" in failed["detail"] and "gguf" in failed["detail"].lower()
    assert ok["tokens_out"] == 5  # the route's max_tokens of the candidate that answered
    (cool,) = ledger.read(s).cooldowns.values()
    assert (cool["reason"], cool["failures"]) == ("load", 1)
    assert list(ledger.read(s).cooldowns) == [cid(m.choice.verdicts[0].candidate)]
    nxt = router.get_model("t")
    assert nxt.name == "tiny-llama"
    assert "rejected: cpu bad (routes.t[0]): cooling down after errors for " in nxt.why
    assert "more (last: load)" in nxt.why


def test_an_allocation_failure_in_llama_cpps_log_is_an_oom_the_governor_counts(
    world: World, tiny: Path
) -> None:
    # A CUDA out-of-memory shows only in llama.cpp's log ("Failed to create llama_context" is
    # all the exception says); this machine has no GPU to run out of, so the log is given.
    from gpulock.router.backends import BackendError
    from gpulock.router.backends.llama_cpp import LlamaBackend
    from gpulock.router.routes import load_table

    s = configure(world, gpu_and_cpu(tiny))
    c = load_table(s.config).tasks["t"][0]
    b = LlamaBackend(c, s, gpu=0, need=1 << 30)
    log = [
        "llama_init_from_model: n_ctx = 8192",
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: "
        "cudaMalloc failed: out of memory",
        "llama_init_from_model: failed to initialize the context",
    ]
    with pytest.raises(BackendError) as e:
        b._failed(ValueError("Failed to create llama_context"), "load", log)
    assert e.value.kind == "oom" and e.value.detail is not None
    assert "cudaMalloc failed: out of memory" in e.value.detail
    (oom,) = world.events("oom")
    assert (oom["gpu"], oom["name"]) == (0, c.name)
    with pytest.raises(BackendError) as e:
        b._failed(ValueError("Failed to load model from file"), "load", log[:1])
    assert e.value.kind == "load"


def test_when_every_candidate_fails_the_error_lists_each_and_why(world: World) -> None:
    bad = world.root / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    configure(world, f"t:\n  - {{tier: cpu, backend: llama_cpp, model: {bad}}}\n")
    m = router.get_model("t")
    with pytest.raises(router.NoModelAvailable) as info:
        m.complete("x")
    e = info.value
    assert e.reasons == [("routes.t[0]", "bad", "cpu", "failed on this call already: load")]
    assert str(e).splitlines() == [
        "no model available for task 't'",
        "  cpu bad (routes.t[0]): failed on this call already: load",
    ]
    assert e.hint == "gpulock route t --explain"
    assert e.exit_code == 75


def test_a_missing_model_file_is_rejected_naming_its_key(world: World, tiny: Path) -> None:
    gone = world.root / "models" / "gone.gguf"
    configure(
        world,
        f"""
        t:
          - {{tier: gpu, backend: llama_cpp, model: {gone}}}
          - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256}}
        only:
          - {{tier: cpu, backend: llama_cpp, model: {gone}}}
        """,
    )
    m = router.get_model("t")
    assert m.name == "tiny-llama"
    why = f"rejected: gpu gone (routes.t[0]): model file not found: {gone} (routes.t[0].model)"
    assert why in m.why
    with pytest.raises(router.NoModelAvailable) as info:
        router.get_model("only")
    assert info.value.reasons == [
        ("routes.only[0]", "gone", "cpu", f"model file not found: {gone} (routes.only[0].model)")
    ]
    assert "(routes.only[0].model)" in str(info.value)
    (route,) = world.events("route", task="only")
    assert route["model"] is None and route["rejected"][0]["reason"].startswith("model file")


def test_an_unknown_task_lists_the_known_ones(world: World, tiny: Path) -> None:
    configure(world, gpu_and_cpu(tiny).rstrip() + "\n    digest: {inherit: t}\n")
    with pytest.raises(router.UnknownTask) as info:
        router.get_model("summarise")
    e = info.value
    assert str(e) == "unknown task 'summarise'"
    assert e.hint == "known tasks: digest, t"
    assert (e.task, e.known, e.exit_code) == ("summarise", ["digest", "t"], 2)
    assert isinstance(e, KeyError)
    with pytest.raises(router.UnknownTask):
        router.explain("summarise")


def test_a_bad_deadline_is_a_value_error(world: World, tiny: Path) -> None:
    configure(world, gpu_and_cpu(tiny))
    with pytest.raises(ValueError, match="deadline must be seconds >= 0"):
        router.get_model("t", deadline=-1)
    with pytest.raises(ValueError, match="deadline must be seconds >= 0"):
        router.explain("t", deadline=float("nan"))
    with pytest.raises(ValueError, match="'soon' is not a duration"):
        router.get_model("t", deadline="soon")


def test_a_deadline_may_be_a_duration_as_gpulock_acquire_takes_it(world: World, tiny: Path) -> None:
    configure(world, gpu_and_cpu(tiny), extra="router: {hold_estimate: 90s}\n")
    holder = world.hold("holder")  # a real process holding gpu0, whole
    chosen = router.explain("t", deadline="2m").candidate
    assert chosen is not None and chosen.tier == "gpu"  # ~90 s is within 2 minutes
    m = router.get_model("t", deadline="1m")
    assert m.tier == "cpu"
    assert "(1 ahead) > deadline 1m00s" in m.why
    holder.release()
    holder.wait_exit()


def test_prefer_picks_the_cpu_even_with_a_gpu_free(world: World, tiny: Path) -> None:
    configure(world, gpu_and_cpu(tiny))
    m = router.get_model("t", prefer="cpu")
    assert m.tier == "cpu"
    m.complete("x", max_tokens=2)
    assert world.events("acquire") == []


def test_a_preference_that_names_nothing_raises_before_anything_loads(
    world: World, tiny: Path
) -> None:
    configure(world, gpu_and_cpu(tiny))
    with pytest.raises(router.UnknownPreference) as e:
        router.get_model("t", prefer="tiny-lama")
    assert isinstance(e.value, ValueError) and "models of t: tiny-llama" in (e.value.hint or "")
    assert world.events("route") == []
    assert router.get_model("t", prefer=str(tiny)).tier == "gpu"  # the model's path names it


def test_a_changed_config_is_read_again(world: World, tiny: Path) -> None:
    configure(world, gpu_and_cpu(tiny))
    assert router.get_model("t").tier == "gpu"
    configure(world, f"t:\n  - {{tier: cpu, backend: llama_cpp, model: {tiny}}}\n# changed\n")
    assert router.get_model("t").tier == "cpu"


# --- the ledger: damaged entries, and files that are not files ---------------------------------


def ledger_file(world: World, text: str) -> Settings:
    s = world.settings()
    folder = s.state_dir / ledger.FOLDER
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / ledger.FILE).write_text(text)
    return s


def test_damaged_ledger_entries_are_dropped_not_kept_for_ever(world: World) -> None:
    now = time.time()
    day = calendar_day(now)
    damaged = {
        "format": "gpulock.ledger/1",
        "day": day,
        "spend_usd": {"k": math.nan, "j": math.inf},
        "usage": {"agent": {"a": {"calls": "many", "tokens_in": math.inf, "tokens_out": 7}}},
        "requests": {
            "k": [math.inf, 1e300, "x", now - 1],  # an older file: a wall time a request
            "n": {  # counts by second
                "x": 1,
                "1e300": 2,
                "nan": 1,
                str(int(now)): "many",
                str(int(now) - 1): 3,
                str(int(now) - 2): -4,
                str(int(now) + 3600): 1,
            },
        },
        "cooldowns": {
            "k": {"until_wall": math.inf},
            "j": {"until_wall": now + 30, "failures": "x"},
        },
    }
    s = ledger_file(world, json.dumps(damaged))  # NaN and Infinity: what json.dumps writes
    led = ledger.read(s, now_wall=now)
    assert led.spend_usd == {}  # NaN would switch the budget off: NaN >= budget is False
    assert led.usage["agent"]["a"] == {
        "calls": 0.0, "tokens_in": 0.0, "tokens_out": 7.0, "cost_usd": 0.0
    }  # fmt: skip
    assert led.requests == {  # an infinite time, or one an hour ahead, would count for ever
        "k": {int((now - 1) // 1): 1},
        "n": {int(now) - 1: 3},
    }
    assert list(led.cooldowns) == ["j"]  # an endless cooldown would reject "k" for ever
    ledger.record_call(s, "k", cost_usd=2.0, tier="cloud", now_wall=now)
    assert ledger.read(s, now_wall=now).spend_usd == {"k": 2.0}
    assert ledger.record_failure(s, "j", reason="x", base_s=60, max_s=600, now_wall=now) == 60.0


def test_a_ledger_nested_past_the_parsers_depth_is_read_as_empty(world: World) -> None:
    s = ledger_file(world, "[" * 100_000)
    assert ledger.read(s).to_json()["spend_usd"] == {}
    ledger.record_call(s, "k", cost_usd=1.0, tier="cloud")
    assert ledger.read(s).spend_usd == {"k": 1.0}


@pytest.mark.parametrize("what", ["lock-folder", "lock-symlink", "lock-fifo", "ledger-folder"])
def test_a_lock_or_ledger_that_is_not_a_file_is_a_clear_error(world: World, what: str) -> None:
    s = world.settings()
    folder = s.state_dir / ledger.FOLDER
    folder.mkdir(mode=0o700)
    outside = world.root / "outside"
    if what == "lock-folder":
        (folder / ledger.LOCK_FILE).mkdir()
    elif what == "lock-symlink":
        (folder / ledger.LOCK_FILE).symlink_to(outside)
    elif what == "lock-fifo":
        os.mkfifo(folder / ledger.LOCK_FILE)
    else:
        (folder / ledger.FILE).mkdir()
    with pytest.raises(StateDirError) as caught:
        ledger.record_call(s, "k", cost_usd=1.0, tier="cloud")
    assert caught.value.hint, caught.value
    with pytest.raises(StateDirError):
        ledger.record_failure(s, "k", reason="x", base_s=60, max_s=600)
    assert not outside.exists()
    assert ledger.read(s).spend_usd == {}  # the probe reads on: it never fails a choice


def test_the_ledger_and_its_lock_are_shared_with_the_group(world: World) -> None:
    import grp

    world.config.write_text(f"group: {grp.getgrgid(os.getgid()).gr_name}\n")
    old = os.umask(0o077)  # would make every file 0600 unless the mode is set explicitly
    try:
        ledger.record_call(world.settings(), "k", cost_usd=1.0, tier="cloud")
    finally:
        os.umask(old)
    folder = world.state / ledger.FOLDER
    for name in (ledger.FILE, ledger.LOCK_FILE):
        assert os.stat(folder / name).st_mode & 0o777 == 0o660, name


# --- several GPUs (issue 28) -------------------------------------------------------------------


def test_a_local_model_without_gpu_waits_for_every_gpu_and_loads_where_granted(
    world: World, tiny: Path
) -> None:
    """Two GPUs; gpu1 is held (exclusively) by another process when the call is chosen, gpu0
    by a third soon after: the router saw gpu0 free, but the ticket waits for the set, not for
    the GPU that looked shortest, and the model loads (and stays) on the GPU it got."""
    configure(world, gpu_and_cpu(tiny))
    text = world.config.read_text().replace("simulate: 24GiB\n", "simulate: 24GiB,24GiB\n")
    world.config.write_text(text)
    s = world.settings()
    need = estimate(tiny, 256)
    h1 = world.hold("h1", gpu=1)
    m = router.get_model("t", agent=AGENT)
    chosen = m.choice.chosen
    assert chosen is not None and chosen.gpus == (0, 1) and chosen.gpu == 0
    assert m.why.splitlines()[0].startswith("t: gpu tiny-llama (routes.t[0]): any of gpus 0,1:")
    h0 = world.hold("h0", gpu=0)  # now the GPU that looked free is taken
    out: list[str] = []
    caller = threading.Thread(target=lambda: out.append(m.complete("hello", max_tokens=2)))
    caller.start()
    world.wait_event("wait", name=f"{AGENT}:t")
    h1.release()  # gpu1 frees first: the call goes there
    caller.join(60)
    assert out and printable(out[0])
    (acq,) = world.events("acquire", name=f"{AGENT}:t")
    assert (acq["gpus"], acq["granted"], acq["need_bytes"]) == ([0, 1], [1], need)
    (rec,) = records(s)
    assert rec.gpu == 1  # registered where it loaded
    # Loaded on gpu1, it keeps gpu1: the next call waits there only, wherever else is free.
    h0.release()
    m.complete("again", max_tokens=2)
    acq2 = world.events("acquire", name=f"{AGENT}:t")[-1]
    assert acq2["gpu"] == 1 and "gpus" not in acq2
    assert len(world.events("model-load")) == 1
