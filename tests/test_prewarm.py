"""Pre-warm: a model confidently needed within ``prewarm.lead`` starts warm.

The decision's table tests (``gpulock.core.prewarm.plan``, pure), then the real thing: a real
governor pass reads a real file (evicted from the page cache first) into the page cache before
a cron agent's predicted run, yields to a real ticket in the line (before and in the middle of
a read), and asks a tenant (the Ollama stand-in: Ollama cannot run here) to load a model ahead,
which is then the first victim when a ticket needs room.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Cli
from standins.ollama import Ollama
from tenant_helpers import settings_for, write_config

from gpulock.core import events, pagecache
from gpulock.core import foresight as fs
from gpulock.core import prewarm as pw
from gpulock.core.config import parse_config
from gpulock.core.errors import ConfigError
from gpulock.core.settings import load
from gpulock.governor.daemon import Governor
from gpulock.governor.model import GovernorConfig
from gpulock.residents import eviction
from gpulock.residents.prewarm import Prewarmer, file_state
from gpulock.residents.prewarm_state import loaded_ahead

GiB = 1024**3
MiB = 1024**2
NOW = 1_800_000_000.0
OPTS = pw.Options()


def cand(model: str, in_s: float | None, conf: float = 0.95, **kw: Any) -> pw.Candidate:
    at = None if in_s is None else NOW + in_s
    return pw.Candidate(model, fs.NextUse(model, at, conf, "cron", f"agent-{model}"), **kw)


def file_cand(model: str, in_s: float, cached: float = 0.0, size: int = GiB) -> pw.Candidate:
    return cand(model, in_s, path=f"/m/{model}.gguf", file_bytes=size, cached_fraction=cached)


def world(**kw: Any) -> pw.World:
    return pw.World(NOW, **{"mem_available_bytes": 16 * GiB, "disk_busy": 0.0, **kw})


# --- the decision ----------------------------------------------------------------------------


def test_a_confident_use_within_the_lead_is_warmed_soonest_first() -> None:
    cands = [
        file_cand("later", 100),
        file_cand("soon", 30),
        file_cand("far", 3600),  # beyond the 2-minute lead
        cand("unsure", 20, conf=0.6, path="/m/u", file_bytes=GiB, cached_fraction=0.0),
        file_cand("cached", 10, cached=1.0),
    ]
    warms, skips = pw.plan(cands, world(), OPTS)
    assert [(w.model, w.how) for w in warms] == [("soon", "page-cache")]
    assert warms[0].why(NOW) == {
        "next_use_wall": NOW + 30, "next_use_s": 30.0, "next_use_source": "cron",
        "next_use_by": "agent-soon", "confidence": 0.95,
    }  # fmt: skip
    assert [(s.model, s.reason) for s in skips] == [("later", "another file is warming")]
    assert pw.plan(cands, world(), pw.Options(enabled=False)) == ([], [])


def test_the_page_cache_pass_yields_to_jobs_a_busy_disk_and_models_needed_sooner() -> None:
    one = [file_cand("m", 60)]
    assert pw.plan(one, world(busy_gpus=frozenset({0})), OPTS)[1][0].reason == (
        "a job holds or waits for a GPU"
    )
    assert pw.plan(one, world(disk_busy=0.9), OPTS)[1][0].reason == "disk busy (90%)"
    # 4 GiB available; the model needed sooner holds 3 GiB of cache: reading 1 GiB (x1.5
    # margin) for the later one would push it out
    both = [file_cand("first", 30, cached=1.0, size=3 * GiB), file_cand("second", 60)]
    warms, skips = pw.plan(both, world(mem_available_bytes=4 * GiB), OPTS)
    assert warms == [] and skips[0].reason.startswith("low memory")
    warms, _ = pw.plan(both, world(mem_available_bytes=5 * GiB), OPTS)
    assert [w.model for w in warms] == ["second"]


def test_a_load_ahead_needs_an_idle_gpu_and_free_memory_and_never_evicts() -> None:
    c = cand("qwen", 60, tenant="ollama", gpu=0, bytes=4 * GiB, path="/m/q", file_bytes=GiB)
    free = {0: 10 * GiB}
    warms, _ = pw.plan([c], world(gpu_free_bytes=free), OPTS)
    # and its file beside it: a server that maps its file reads it on the first request
    assert [(w.model, w.how, w.tenant, w.gpu, w.bytes) for w in warms] == [
        ("qwen", "load", "ollama", 0, 4 * GiB),
        ("qwen", "page-cache", None, 0, GiB),
    ]
    _, skips = pw.plan([c], world(gpu_free_bytes={0: 3 * GiB}), OPTS)
    assert skips[0].reason.startswith("not enough free GPU memory")
    warms, skips = pw.plan([c], world(gpu_free_bytes=free, busy_gpus=frozenset({0})), OPTS)
    assert warms == [] and skips[0].reason == "its GPU is busy"
    unknown = cand("qwen", 60, tenant="ollama", gpu=0)
    assert "unknown" in pw.plan([unknown], world(gpu_free_bytes=free), OPTS)[1][0].reason


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("prewarm:\n  lead: soon\n", "prewarm.lead", "expected a duration"),
        ("prewarm:\n  min_confidence: 2\n", "prewarm.min_confidence", "at most 1"),
        ("prewarm:\n  leed: 2m\n", "prewarm.leed", "did you mean 'lead'?"),
        ("prewarm:\n  enabled: yes please\n", "prewarm.enabled", "true or false"),
        ("prewarm: 2m\n", "prewarm", "expected a mapping"),
    ],
)
def test_a_bad_prewarm_section_names_file_line_and_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        pw.options(parse_config(text, "c.yaml"))
    assert f"c.yaml:2: {key}:" in str(e.value) or f"c.yaml:1: {key}:" in str(e.value)
    assert words in str(e.value) + (e.value.hint or "")
    assert pw.options(parse_config("prewarm:\n  lead: 5m\n", "c.yaml")).lead_s == 300.0


# --- the real thing --------------------------------------------------------------------------


def write_file(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    pagecache.drop_from_cache(path)
    return path


def cached(path: Path) -> float:
    _size, share = file_state(str(path))
    assert share is not None
    return share


def past_events(now: float, model: str, *, path: Path | None = None, tenant: str | None = None,
                agent: str = "digest", every_s: float = 600.0, due_in_s: float = 10.0
                ) -> list[dict[str, Any]]:  # fmt: skip
    """A cron agent that called ``model`` every ``every_s``, next due in ``due_in_s``."""
    evs: list[dict[str, Any]] = []
    last = now + due_in_s - every_s
    for k in range(5):
        t = last - every_s * (4 - k)
        if k == 0 and path is not None:
            evs.append({"ts": t - 1, "event": "model-load", "model": model, "gpu": 0,
                        "path": str(path), "need_bytes": 2 * GiB, "load_s": 3.0})  # fmt: skip
        if k == 0 and tenant is not None:
            evs.append({"ts": t - 1, "event": "resident", "name": model, "tenant": tenant,
                        "gpu": 0, "declared_bytes": 4 * GiB})  # fmt: skip
        call = {"ts": t, "event": "call", "agent": agent, "model": model, "tier": "gpu"}
        evs.append(call | ({"tenant": tenant} if tenant else {}))
    return evs


def write_events(state: Path, evs: list[dict[str, Any]]) -> None:
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (state / "events.jsonl").open("a") as f:
        for e in sorted(evs, key=lambda e: e["ts"]):
            f.write(json.dumps(e) + "\n")


def prewarms(state: Path) -> list[dict[str, Any]]:
    return [e for e in events.read(state) if e["event"] == "prewarm"]


def test_a_governor_pass_reads_a_cron_agents_model_into_the_page_cache_before_its_run(
    cli: Cli, tmp_path: Path
) -> None:
    model = write_file(tmp_path / "digest.gguf", 48 * MiB)
    assert cached(model) < 0.5
    write_events(cli.state, past_events(time.time(), "digest-7b", path=model))
    r = cli.run("governor", "--once")
    assert r.code == 0, r.describe()
    (ev,) = prewarms(cli.state)
    assert (ev["model"], ev["how"], ev["outcome"]) == ("digest-7b", "page-cache", "warm")
    assert (ev["next_use_source"], ev["next_use_by"]) == ("rhythm", "digest")
    assert ev["confidence"] >= 0.8 and 0 <= ev["next_use_s"] <= 120
    assert ev["path"] == str(model) and ev["bytes"] == 48 * MiB
    assert cached(model) >= 0.98
    r = cli.run("status")
    assert "warming ahead (gpulock governor)" in r.stdout, r.describe()
    assert "digest-7b  page cache  warm" in r.stdout and "(digest, rhythm, " in r.stdout
    doc = cli.status()
    (entry,) = doc["prewarm"]["entries"]
    assert entry["state"] == "warm" and entry["next_use_by"] == "digest"


def test_a_prewarm_yields_to_a_real_ticket_before_and_during_a_read(
    cli: Cli, tmp_path: Path
) -> None:
    model = write_file(tmp_path / "digest.gguf", 48 * MiB)
    write_events(cli.state, past_events(time.time(), "digest-7b", path=model))
    holder = cli.hold("backup")
    try:
        r = cli.run("governor", "--once")
        assert r.code == 0, r.describe()
        assert prewarms(cli.state) == [] and cached(model) < 0.5
        r = cli.run("status")
        assert "not warming digest-7b (page cache): a job holds or waits for a GPU" in r.stdout
    finally:
        holder.release()
        holder.wait()
    # during: a job takes the line after the first chunk; the read stops before the next
    settings = load(None, cli.state)
    started: list[Any] = []

    def job_arrives(read: int) -> None:
        if not started:
            started.append(cli.hold("late"))

    warmer = Prewarmer(settings, on_chunk=job_arrives)
    try:
        warms = warmer.tick(time.time(), resident=(), free_bytes={0: 20 * GiB})
        assert [w.how for w in warms] == ["page-cache"]
        warmer.wait(30.0)
    finally:
        for p in started:
            p.release()
            p.wait()
    (ev,) = prewarms(cli.state)
    assert (ev["outcome"], ev["reason"]) == ("stopped", "a job holds or waits for a GPU")
    assert ev["bytes_read"] == 8 * MiB  # one chunk, then it yielded


def test_a_tenant_loads_ahead_and_a_load_ahead_is_undone_first(tmp_path: Path) -> None:
    srv = Ollama({"qwen": 4 * GiB, "other": 4 * GiB}).start()
    try:
        settings = settings_for(tmp_path, [{"name": "ollama", "kind": "ollama", "url": srv.url}])
        now = time.time()
        evs = past_events(now, "qwen", tenant="ollama", due_in_s=10.0)
        evs += past_events(now, "other", tenant="ollama", agent="tagger", every_s=300,
                           due_in_s=60.0)  # fmt: skip
        write_events(settings.state_dir, evs)
        srv.load("other")
        gov = Governor(settings, GovernorConfig())
        gov.once()  # waits for the load it started
        assert "qwen" in srv.loaded
        load = next(b for m, p, b in srv.hits if p == "/api/generate" and b["model"] == "qwen")
        assert "prompt" not in load and load["keep_alive"] >= 300  # past its use
        (ev,) = prewarms(settings.state_dir)
        assert (ev["model"], ev["how"], ev["outcome"], ev["tenant"]) == (
            "qwen", "load", "loaded", "ollama")  # fmt: skip
        assert ev["next_use_by"] == "digest" and ev["next_use_source"] == "rhythm"
        assert list(loaded_ahead(settings)) == ["ollama/qwen"]
        # a ticket needs room for one model: qwen goes first, though foresight alone would
        # keep it (needed in 10 s, other in 60 s): a guess gives way to a real need
        got = eviction.make_room(settings, 0, 20 * GiB, exclude_pid=os.getpid(), name="backup")
        assert [r.name for r in got] == ["qwen"]
        (evict,) = [e for e in events.read(settings.state_dir) if e["event"] == "evict"]
        assert evict["prewarm"] == "loaded ahead, not used yet: undone first"
        # once its job has called it, a model loaded ahead is like any other
        srv.load("qwen")
        write_events(settings.state_dir, [{"ts": time.time() + 1, "event": "call",
                                           "agent": "digest", "model": "qwen",
                                           "tenant": "ollama"}])  # fmt: skip
        assert loaded_ahead(settings) == {}
    finally:
        srv.stop()


def test_status_and_a_cron_governor_keep_a_load_ahead_after_the_pass_exits(
    cli: Cli, tmp_path: Path
) -> None:
    srv = Ollama({"qwen": 4 * GiB}).start()
    try:
        cfg = write_config(tmp_path, [{"name": "ollama", "kind": "ollama", "url": srv.url}])
        env = cli.env(GPULOCK_CONFIG=str(cfg))
        write_events(cli.state, past_events(time.time(), "qwen", tenant="ollama"))
        r = cli.run("governor", "--once", env=env)
        assert r.code == 0, r.describe()
        assert "qwen" in srv.loaded
        r = cli.run("status", env=env)
        assert "qwen   loading on ollama  loaded" in r.stdout, r.describe()
        settings = load(str(cfg), cli.state)
        assert list(loaded_ahead(settings)) == ["ollama/qwen"]  # its pass has exited
    finally:
        srv.stop()


def test_a_real_llama_server_router_loads_a_model_ahead(tmp_path: Path) -> None:
    from llama_router import LlamaRouter

    from gpulock.router.tiny_model import ensure_tiny_llama

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-a.gguf").write_bytes(ensure_tiny_llama(tmp_path / "tiny").read_bytes())
    router = LlamaRouter(models, tmp_path / "llama-server.log").start()
    try:
        tenants = [{"name": "llama", "kind": "llama-server", "url": router.url}]
        settings = settings_for(tmp_path, tenants)
        evs = past_events(time.time(), "tiny-a", tenant="llama")
        for e in evs:  # a tiny model: its size as the router reported it when it last ran
            if e["event"] == "resident":
                e["declared_bytes"] = 16 * MiB
        write_events(settings.state_dir, evs)
        assert router.states()["tiny-a"] == "unloaded"
        Governor(settings, GovernorConfig()).once()
        assert router.states()["tiny-a"] == "loaded"  # listed loaded before the event
        (ev,) = prewarms(settings.state_dir)
        assert (ev["how"], ev["outcome"], ev["tenant"]) == ("load", "loaded", "llama")
        # the router names the model's file: the next pre-warm reads it into the page cache too
        Governor(settings, GovernorConfig()).once()
        seen = [e for e in events.read(settings.state_dir)
                if e["event"] == "resident" and e.get("tenant") == "llama"]  # fmt: skip
        assert seen and seen[-1]["path"] == str(models / "tiny-a.gguf")
    finally:
        router.stop()
