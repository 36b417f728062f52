"""``kind: command`` with a real server: ``python -m llama_cpp.server`` on the tiny model.

Started on demand under a GPU ticket with its ``need``, ready-waited on ``health``, listed as a
resident, stopped to evict (SIGTERM; no process left), and a crash while starting reported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from router_servers import free_port
from tenant_helpers import settings_for

from gpulock import status as status_mod
from gpulock.core import events
from gpulock.core.settings import Settings
from gpulock.lock.queuedir import QueueDir
from gpulock.residents import eviction
from gpulock.tenants import survey
from gpulock.tenants.command import CommandAdapter
from gpulock.tenants.http import TenantError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpulock.router.tiny_model import ensure_tiny_llama

    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


def server_spec(model: Path, port: int, **extra: object) -> dict[str, object]:
    return {
        "name": "tiny",
        "kind": "command",
        "command": [
            sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", "256",
            "--n_gpu_layers", "0", "--host", "127.0.0.1", "--port", str(port),
        ],
        "url": f"http://127.0.0.1:{port}",
        "health": "/v1/models",
        "need": "1GiB",
        "models": ["tiny-chat"],
        "ready_timeout": "90s",
        "stop_timeout": "10s",
        **extra,
    }  # fmt: skip


@pytest.fixture
def started(tiny: Path, tmp_path: Path) -> Iterator[tuple[Settings, CommandAdapter]]:
    settings = settings_for(tmp_path, [server_spec(tiny, free_port())])
    adapter = survey.adapter_for(settings.config.tenants[0], settings)
    assert isinstance(adapter, CommandAdapter)
    try:
        yield settings, adapter
    finally:
        adapter.unload("tiny-chat")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_started_on_demand_listed_then_stopped_to_evict(
    started: tuple[Settings, CommandAdapter],
) -> None:
    settings, adapter = started
    assert survey.survey(settings)[0].models == ()  # not running yet
    adapter.load()
    (li,) = survey.survey(settings)
    (m,) = li.models
    assert (m.name, m.state, m.size_bytes) == ("tiny-chat", "loaded", 1024**3)
    server_pid = m.pid
    assert server_pid is not None and alive(server_pid)
    (holder,) = QueueDir(settings, 0, create=False).holders()
    assert (holder.name, holder.need_bytes, holder.child_pid) == (
        "tenant:tiny",
        1024**3,
        server_pid,
    )
    snap = status_mod.snapshot(settings)
    assert [(r["id"], r["tenant"]) for r in snap["residents"]] == [("tiny/tiny-chat", "tiny")]
    assert snap["devices"][0]["used_bytes"] == 1024**3  # counted once: the ticket's need
    (rec,) = eviction.find(settings, "tiny-chat", tenant="tiny")
    res = eviction.evict(settings, rec)
    assert res.outcome == "freed", res
    assert "stopped" in res.detail
    assert not alive(server_pid)
    assert QueueDir(settings, 0, create=False).holders() == []
    assert survey.survey(settings)[0].models == ()


def test_a_crash_while_starting_is_reported(tmp_path: Path) -> None:
    port = free_port()
    spec = {
        "name": "broken",
        "kind": "command",
        "command": [
            sys.executable,
            "-c",
            "import sys; print('cannot open model.gguf'); sys.exit(3)",
        ],
        "url": f"http://127.0.0.1:{port}",
        "need": "1GiB",
        "ready_timeout": "60s",
    }
    settings = settings_for(tmp_path, [spec])
    adapter = survey.adapter_for(settings.config.tenants[0], settings)
    with pytest.raises(TenantError) as e:
        adapter.load()
    text = str(e.value)
    assert "exited with status 3" in text and "cannot open model.gguf" in text
    assert e.value.hint is not None and "broken.log" in e.value.hint
    assert QueueDir(settings, 0, create=False).holders() == []
    assert not [x for x in events.read(settings.state_dir) if x["event"] == "evict"]


def test_an_exclusive_acquire_stops_an_idle_command_tenant_instead_of_waiting_for_ever(
    started: tuple[Settings, CommandAdapter],
) -> None:
    import gpulock

    settings, adapter = started
    adapter.load()
    (m,) = survey.survey(settings)[0].models
    assert m.pid is not None
    cfg, state = str(settings.config.path), settings.state_dir
    with gpulock.acquire(timeout=60, config=cfg, state_dir=state) as lease:
        assert lease.need_bytes is None
        assert not alive(m.pid)
    (ev,) = [e for e in events.read(state) if e["event"] == "evict"]
    assert (ev["tenant"], ev["outcome"]) == ("tiny", "freed")


def test_the_servers_model_file_is_warmed_while_its_ticket_waits(
    tiny: Path, tmp_path: Path
) -> None:
    from gpulock.tenants.command import model_files

    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert model_files(["srv", "-m", str(tiny), str(other), "--model=/no/such.gguf"]) == [
        str(tiny),
        str(other),
    ]
    settings = settings_for(tmp_path, [server_spec(tiny, free_port())])
    adapter = survey.adapter_for(settings.config.tenants[0], settings)
    assert isinstance(adapter, CommandAdapter)
    argv = list(adapter.run_argv())
    head = argv[: argv.index("--")]
    assert head[head.index("--prefetch") + 1] == str(tiny)  # gpulock run warms it in line
