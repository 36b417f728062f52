"""Tenants against stand-ins of Ollama, vLLM, ComfyUI, LocalAI and llama-swap (tests/standins).

The same contract runs against a real server when its URL is in the environment:
``GPULOCK_TEST_OLLAMA_URL`` (with ``GPULOCK_TEST_OLLAMA_MODEL``, a small model it has pulled),
and likewise ``..._VLLM_...``, ``..._LOCALAI_...``, ``..._LLAMA_SWAP_...``, ``..._COMFYUI_URL``.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from standins.bad import Bad
from standins.base import StandIn
from standins.comfyui import ComfyUI
from standins.llama_swap import LlamaSwap
from standins.localai import LocalAI
from standins.ollama import Ollama
from standins.vllm import Vllm
from tenant_helpers import settings_for

import gpulock
from gpulock import status as status_mod
from gpulock.core import events
from gpulock.residents import eviction, registry, tenant_evict
from gpulock.tenants import survey

GiB = 1024**3


@dataclass
class Server:
    kind: str
    url: str
    model: str
    standin: StandIn | None  # None: a real server from the environment

    def load(self) -> None:
        """Get ``model`` into memory the way a user's call would."""
        s = self.standin
        if isinstance(s, Ollama):
            s.load(self.model)
        elif isinstance(s, Vllm):
            s.sleeping = False
        elif isinstance(s, ComfyUI):
            s.held = 3 * GiB
        elif isinstance(s, LocalAI):
            s.loaded.add(self.model)
        elif isinstance(s, LlamaSwap):
            s.running[self.model] = "ready"
        else:
            spec = {"name": "t", "kind": self.kind, "url": self.url}
            from tenant_helpers import settings_for as sf

            settings = sf(Path(os.environ.get("TMPDIR", "/tmp")), [spec])
            survey.adapter_for(settings.config.tenants[0], settings, timeout_s=120).load(self.model)


def make(kind: str) -> Server:
    env = kind.upper().replace("-", "_")
    url = os.environ.get(f"GPULOCK_TEST_{env}_URL")
    if url:
        return Server(kind, url, os.environ.get(f"GPULOCK_TEST_{env}_MODEL", "comfy"), None)
    if kind == "ollama":
        s: StandIn = Ollama({"qwen2.5:7b": 5 * GiB, "nomic-embed-text": GiB // 2})
        model = "qwen2.5:7b"
    elif kind == "vllm":
        s, model = Vllm("Qwen/Qwen2.5-1.5B-Instruct"), "Qwen/Qwen2.5-1.5B-Instruct"
    elif kind == "comfyui":
        s, model = ComfyUI(total=24 * GiB, held=0), "comfy"
    elif kind == "localai":
        s, model = LocalAI({"phi-2": 2 * GiB}), "phi-2"
    else:
        s, model = LlamaSwap(["qwen-coder"]), "qwen-coder"
    s.start()
    return Server(kind, s.url, model, s)


KINDS = ["ollama", "vllm", "comfyui", "localai", "llama-swap"]


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = make(request.param)
    try:
        yield srv
    finally:
        if srv.standin is not None:
            srv.standin.stop()


def tenant(srv: Server, **extra: Any) -> dict[str, Any]:
    name = "comfy" if srv.kind == "comfyui" else srv.kind
    return {"name": name, "kind": srv.kind, "url": srv.url, **extra}


def test_contract_list_evict_verify(server: Server, tmp_path: Path) -> None:
    settings = settings_for(tmp_path, [tenant(server)])
    server.load()
    (li,) = survey.survey(settings)
    assert li.reachable, li.error
    assert li.actual_kind == server.kind
    assert server.model in [m.name for m in li.models]
    recs = eviction.find(settings, server.model)
    assert [r.tenant for r in recs] == [settings.config.tenants[0].name]
    res = eviction.evict(settings, recs[0], reason="test")
    assert res.outcome == "freed", res
    (li,) = survey.survey(settings)
    held = [m for m in li.models if m.name == server.model and m.state != "sleeping"]
    assert held == []
    assert eviction.evict(settings, recs[0]).outcome == "gone"
    kinds = [e["outcome"] for e in events.read(settings.state_dir) if e["event"] == "evict"]
    assert kinds == ["freed", "gone"]


def test_status_lists_tenant_models_with_sizes_and_counts_them(tmp_path: Path) -> None:
    ollama, comfy, local = make("ollama"), make("comfyui"), make("localai")
    try:
        settings = settings_for(tmp_path, [tenant(ollama), tenant(comfy), tenant(local)])
        ollama.load()
        comfy.load()
        local.load()
        snap = status_mod.snapshot(settings)
        by_id = {r["id"]: r for r in snap["residents"]}
        assert by_id["ollama/qwen2.5:7b"]["tenant"] == "ollama"
        assert by_id["ollama/qwen2.5:7b"]["bytes"] == 5 * GiB
        assert by_id["comfy/comfy"]["bytes"] == 3 * GiB
        assert by_id["localai/phi-2"]["bytes"] == 2 * GiB
        assert by_id["ollama/qwen2.5:7b"]["idle_s"] is None  # first sighting: unknown
        assert snap["devices"][0]["used_bytes"] == 10 * GiB  # the server's figures count
        assert [t["reachable"] for t in snap["tenants"]] == [True, True, True]
        text = status_mod.render(snap)
        assert "ollama/qwen2.5:7b" in text and "comfy/comfy" in text
        # the second look has evidence: unchanged since first seen, so idle since then
        again = status_mod.snapshot(settings)
        idle = {r["id"]: r["idle_s"] for r in again["residents"]}
        assert idle["ollama/qwen2.5:7b"] is not None
    finally:
        for s in (ollama, comfy, local):
            assert s.standin is not None
            s.standin.stop()


def test_ollama_unload_during_a_generation_is_busy_and_kills_nothing(tmp_path: Path) -> None:
    srv = make("ollama")
    s = srv.standin
    assert isinstance(s, Ollama)
    try:
        settings = settings_for(tmp_path, [tenant(srv)])
        s.hold.clear()
        answer: list[Any] = []

        def generate() -> None:
            req = urllib.request.Request(  # noqa: S310 (http://127.0.0.1 only)
                srv.url + "/api/generate",
                data=b'{"model": "qwen2.5:7b", "prompt": "hi", "stream": false}',
                method="POST",
            )
            with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 (127.0.0.1)
                answer.append(r.read())

        t = threading.Thread(target=generate)
        t.start()
        deadline = time.monotonic() + 30
        while not s.loaded.get("qwen2.5:7b", {}).get("inflight"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (rec,) = eviction.find(settings, "qwen2.5:7b")
        res = tenant_evict.evict(settings, rec, verify_s=0.5)
        assert res.outcome == "busy", res
        assert "in-flight" in res.detail
        (li,) = survey.survey(settings)
        assert [m.state for m in li.models] == ["unloading"]  # expires_at in the past
        s.hold.set()
        t.join(30)
        assert answer and b'"stop"' in answer[0]  # the request finished, it was not killed
        deadline = time.monotonic() + 30
        while survey.survey(settings)[0].models:
            assert time.monotonic() < deadline, "Ollama never freed it after the request"
            time.sleep(0.02)
    finally:
        s.stop()


def test_vllm_sleeps_with_mode_wait_and_says_when_sleep_mode_is_off(tmp_path: Path) -> None:
    on, off = Vllm("m"), Vllm("m", dev_mode=False)
    on.start()
    off.start()
    try:
        settings = settings_for(
            tmp_path,
            [
                {"name": "on", "kind": "vllm", "url": on.url},
                {"name": "off", "kind": "vllm", "url": off.url},
            ],
        )
        res = eviction.evict(settings, eviction.find(settings, "m", tenant="on")[0])
        assert res.outcome == "freed"
        sleeps = [p for m, p, _ in on.hits if p.startswith("/sleep")]
        assert sleeps == ["/sleep?level=1&mode=wait"] and on.aborted == 0
        res = eviction.evict(settings, eviction.find(settings, "m", tenant="off")[0])
        assert res.outcome == "refused"
        assert "VLLM_SERVER_DEV_MODE=1" in res.detail and "--enable-sleep-mode" in res.detail
        li = {x.tenant: x for x in survey.survey(settings)}
        assert any("VLLM_SERVER_DEV_MODE" in n for n in li["off"].notes)
    finally:
        on.stop()
        off.stop()


def test_comfyui_is_not_freed_while_a_job_runs_unless_forced(tmp_path: Path) -> None:
    srv = make("comfyui")
    s = srv.standin
    assert isinstance(s, ComfyUI)
    try:
        settings = settings_for(tmp_path, [tenant(srv)])
        s.held = 6 * GiB
        s.running.append([1, "prompt-id", {}, {}, []])
        (rec,) = eviction.find(settings, "comfy")
        assert rec.in_use
        res = eviction.evict(settings, rec)
        assert res.outcome == "busy"
        assert not [p for _m, p, _b in s.hits if p == "/free"]  # never asked
        s.finish_jobs()
        (rec,) = eviction.find(settings, "comfy")
        res = eviction.evict(settings, rec)
        assert res.outcome == "freed" and res.freed_bytes == 6 * GiB
    finally:
        s.stop()


def test_pinned_models_are_refused_unless_forced(tmp_path: Path) -> None:
    srv = make("ollama")
    assert isinstance(srv.standin, Ollama)
    try:
        settings = settings_for(tmp_path, [tenant(srv, pinned=["qwen2.5:7b"])])
        srv.load()
        (rec,) = eviction.find(settings, "qwen2.5:7b")
        assert rec.policy == "pinned"
        assert eviction.evict(settings, rec).outcome == "refused"
        assert eviction.evict(settings, rec, force=True).outcome == "freed"
    finally:
        srv.standin.stop()


def test_an_exclusive_grant_clears_idle_tenant_models_and_names_what_stays(tmp_path: Path) -> None:
    srv = make("ollama")
    s = srv.standin
    assert isinstance(s, Ollama)
    try:
        settings = settings_for(tmp_path, [tenant(srv, pinned=["nomic-embed-text"])])
        s.load("qwen2.5:7b")
        s.load("nomic-embed-text")
        with gpulock.acquire(config=str(settings.config.path), state_dir=settings.state_dir):
            names = [m.name for m in survey.survey(settings)[0].models]
            assert names == ["nomic-embed-text"]
        (grant,) = [e for e in events.read(settings.state_dir) if e["event"] == "acquire"]
        assert grant["tenants_kept"] == [{"id": "ollama/nomic-embed-text", "why": "pinned"}]
    finally:
        s.stop()


def test_exclusive_clears_tenants_false_leaves_them(tmp_path: Path) -> None:
    srv = make("ollama")
    s = srv.standin
    assert isinstance(s, Ollama)
    try:
        settings = settings_for(tmp_path, [tenant(srv)], exclusive_clears_tenants=False)
        s.load("qwen2.5:7b")
        with gpulock.acquire(config=str(settings.config.path), state_dir=settings.state_dir):
            assert [m.name for m in survey.survey(settings)[0].models] == ["qwen2.5:7b"]
    finally:
        s.stop()


def test_room_for_a_waiter_unloads_idle_tenant_models(tmp_path: Path) -> None:
    srv = make("localai")
    s = srv.standin
    assert isinstance(s, LocalAI)
    s.catalog["big"] = 20 * GiB
    try:
        settings = settings_for(tmp_path, [tenant(srv)])
        s.loaded.add("big")
        cfg, state = str(settings.config.path), settings.state_dir
        with gpulock.acquire(need="10GiB", config=cfg, state_dir=state):
            assert s.loaded == set()
        (ev,) = [e for e in events.read(state) if e["event"] == "evict"]
        assert ev["tenant"] == "localai" and ev["outcome"] == "freed"
        assert ev["reason"].startswith("room for ticket")
    finally:
        s.stop()


@pytest.mark.parametrize("mode", ["500", "garbage", "hang", "file", "list", "down"])
def test_bad_tenants_get_a_clear_state_and_never_break_status(mode: str, tmp_path: Path) -> None:
    bad = Bad(mode, hang_s=3600.0)  # longer than the test: status must not wait for it
    bad.start()
    good = make("ollama")
    try:
        url = bad.url
        if mode == "down":
            bad.stop()
        settings = settings_for(
            tmp_path, [{"name": "bad", "kind": "ollama", "url": url}, tenant(good)]
        )
        good.load()
        got: list[dict[str, Any]] = []
        look = threading.Thread(target=lambda: got.append(status_mod.snapshot(settings)))
        look.daemon = True
        look.start()
        look.join(60)  # "eventually": it answers at all, never waiting for the hung tenant
        assert got, "status waited for the hung tenant"
        snap = got[0]
        entry = {t["tenant"]: t for t in snap["tenants"]}
        assert entry["bad"]["reachable"] is False
        words = {"500": "HTTP 500", "garbage": "not JSON", "hang": "no", "file": "not JSON",
                 "list": "JSON object", "down": "refused"}[mode]  # fmt: skip
        assert words in entry["bad"]["error"], entry["bad"]["error"]
        assert entry["ollama"]["reachable"] is True
        assert [r["id"] for r in snap["residents"]] == ["ollama/qwen2.5:7b"]
        assert "tenant bad" in status_mod.render(snap)
    finally:
        bad.hold.set()
        if mode != "down":
            bad.stop()
        assert good.standin is not None
        good.standin.stop()


def test_used_memory_counts_tenant_models_on_a_simulated_gpu(tmp_path: Path) -> None:
    srv = make("localai")
    try:
        settings = settings_for(tmp_path, [tenant(srv)])
        srv.load()
        assert registry.probe_devices(settings).get(0).used_bytes == 2 * GiB  # type: ignore[union-attr]
    finally:
        assert srv.standin is not None
        srv.standin.stop()


def test_a_server_echoing_the_key_never_puts_it_in_errors_or_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-test-0123456789abcdefSECRET"
    monkeypatch.setenv("OLLAMA_KEY", key)
    bad = Bad("echo")
    bad.start()
    try:
        settings = settings_for(
            tmp_path, [{"name": "o", "kind": "ollama", "url": bad.url, "api_key_env": "OLLAMA_KEY"}]
        )
        (li,) = survey.survey(settings)
        assert bad.last_headers.get("Authorization") == f"Bearer {key}"  # it did travel
        assert li.error is not None and "HTTP 500" in li.error
        assert key not in li.error and "[api key]" in li.error
        snap = status_mod.snapshot(settings)
        assert key not in str(snap)
        log = settings.state_dir / "events.jsonl"
        assert not log.exists() or key not in log.read_text(errors="replace")
    finally:
        bad.stop()


def test_a_tenant_residency_is_an_event_when_seen_and_when_gone(tmp_path: Path) -> None:
    srv = make("localai")
    s = srv.standin
    assert isinstance(s, LocalAI)
    try:
        settings = settings_for(tmp_path, [tenant(srv)])
        srv.load()
        status_mod.snapshot(settings)
        status_mod.snapshot(settings)  # seen again: no second event
        s.loaded.clear()  # LocalAI unloaded it by itself
        status_mod.snapshot(settings)
        evs = [(e["event"], e["resident"]) for e in events.read(settings.state_dir)]
        assert evs == [("resident", "localai/phi-2"), ("unload", "localai/phi-2")]
    finally:
        s.stop()


def test_vllm_in_use_from_its_metrics_is_busy_and_not_put_to_sleep(tmp_path: Path) -> None:
    v = Vllm("m")
    v.start()
    try:
        settings = settings_for(tmp_path, [{"name": "v", "kind": "vllm", "url": v.url}])
        v.hold.clear()
        req = urllib.request.Request(  # noqa: S310 (http://127.0.0.1 only)
            v.url + "/v1/completions", data=b"{}", method="POST"
        )
        t = threading.Thread(
            target=lambda: urllib.request.urlopen(req, timeout=60).read()  # noqa: S310
        )
        t.start()
        deadline = time.monotonic() + 30
        while not v.inflight:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (rec,) = eviction.find(settings, "m")
        assert rec.in_use
        assert eviction.evict(settings, rec).outcome == "busy"
        assert not [p for _m, p, _b in v.hits if p.startswith("/sleep")]
        v.hold.set()
        t.join(30)
        (li,) = survey.survey(settings)
        assert li.models[0].in_use is False and li.models[0].fingerprint == "1"
    finally:
        v.stop()


def test_localai_backend_busy_per_its_monitor_is_never_shut_down(tmp_path: Path) -> None:
    srv = make("localai")
    s = srv.standin
    assert isinstance(s, LocalAI)
    try:
        settings = settings_for(tmp_path, [tenant(srv)])
        srv.load()
        s.busy.add("phi-2")
        (rec,) = eviction.find(settings, "phi-2")
        assert rec.in_use and eviction.evict(settings, rec).outcome == "busy"
        assert s.loaded == {"phi-2"}
        s.busy.clear()
        (rec,) = eviction.find(settings, "phi-2")
        assert not rec.in_use and eviction.evict(settings, rec).outcome == "freed"
    finally:
        s.stop()
