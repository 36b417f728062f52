"""Resident models with real owner processes: eviction by request, dead owners, room, admission.

Every model here is owned by a real child process (``tests/resident_child.py``) unless the test
is about one handle's own behaviour (flush, reload), and every eviction goes through the real
``gpulock`` command or the public API.  Simulated GPUs (``GPULOCK_SIMULATE``) make the used
memory what the live residents declare, so "the memory came back" is checked end to end.

What the owner does is decided by the test: it enters ``use()`` and stays inside until told, it
sleeps or spins in its main thread when told; nothing waits on a sleep, every wait has a
deadline and says what it waited for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import GPULOCK, Cli, Result, assert_clean_error
from procs import Child, World, wait_until

import gpulock
from gpulock.core import devices
from gpulock.core.events import read as read_events
from gpulock.residents import adapters, control, eviction, registry
from gpulock.residents.eviction import AdmissionRefused
from gpulock.residents.owner import Evicted
from gpulock.residents.registry import Registry

MiB = 1024**2
GiB = 1024**3
CHILD = Path(__file__).with_name("resident_child.py")
WAIT_S = 10.0  # "it eventually happens", on a busy 2-core machine
WEIGHTS_MB = 20


# --- the owner processes ---------------------------------------------------------------------


class Owner:
    """A child process that owns resident models, and what it wrote to its audit file."""

    def __init__(self, child: Child, audit: Path) -> None:
        self.child = child
        self.audit = audit
        self.ids: dict[str, str] = {}

    @property
    def pid(self) -> int:
        return self.child.pid

    def send(self, line: str) -> None:
        self.child.send(line)

    def lines(self) -> list[tuple[str, str, dict[str, Any]]]:
        try:
            text = self.audit.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            kind, name, extra = line.split(" ", 2)
            out.append((kind, name, json.loads(extra)))
        return out

    def kinds(self) -> list[str]:
        """``["ready -", "entered m", "unloaded m", ...]``, in the order they happened."""
        return [f"{k} {n}" for k, n, _ in self.lines()]

    def find(self, kind: str, name: str = "-") -> dict[str, Any] | None:
        return next((x for k, n, x in self.lines() if k == kind and n == name), None)

    def has(self, kind: str, name: str = "-") -> bool:
        return self.find(kind, name) is not None

    def wait(self, kind: str, name: str = "-", timeout_s: float = WAIT_S) -> dict[str, Any]:
        def found() -> list[dict[str, Any]]:  # a list: the record itself may be {}
            errors = [x for k, _, x in self.lines() if k == "error"]
            if errors:
                raise AssertionError(f"the owner reported an error: {errors}\n{self.describe()}")
            if self.child.proc.poll() is not None and not self.has(kind, name):
                raise AssertionError(
                    f"the owner exited ({self.child.proc.returncode})\n{self.describe()}"
                )
            return [x for k, n, x in self.lines() if k == kind and n == name][:1]

        return wait_until(found, timeout_s, lambda: f"{kind} {name}\n{self.describe()}")[0]

    def describe(self) -> str:
        return "\n".join(["--- owner audit ---", *self.kinds(), self.child.stderr()])


class Lab:
    """One test's world (state folder, config), its ``gpulock`` command and owner processes."""

    def __init__(self, world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
        self.world = world
        self.cli = cli
        self.monkeypatch = monkeypatch
        self.simulate(None)

    def simulate(self, spec: str | None) -> None:
        """Simulated GPUs for this process, the owners started after this, and the CLI."""
        if spec is None:
            self.monkeypatch.delenv(devices.SIMULATE_ENV, raising=False)
        else:
            self.monkeypatch.setenv(devices.SIMULATE_ENV, spec)
        self.cli.simulate = spec

    def owner(self, name: str, *specs: dict[str, Any], **opts: Any) -> Owner:
        """Start an owner of the residents ``specs``; return once all are registered."""
        audit = self.world.root / f"{name}.audit"
        specs = tuple({"weights_mb": WEIGHTS_MB, **s} for s in specs)
        argv = json.dumps({"audit": str(audit), "residents": specs, **opts})
        child = Child(self.world, name, [sys.executable, str(CHILD), argv])
        self.world.children.append(child)
        owner = Owner(child, audit)
        owner.ids = owner.wait("ready", timeout_s=15.0)["ids"]
        return owner

    def gpulock(self, *args: str) -> Result:
        return self.cli.run(*args)

    def settings(self) -> Any:
        return self.world.settings()

    def snapshot(self) -> dict[str, Any]:
        return self.world.snapshot()

    def names(self) -> list[str]:
        """Resident models as ``gpulock status`` shows them (reading never cleans)."""
        return sorted(r["name"] for r in self.snapshot()["residents"])

    def resident(self, name: str) -> dict[str, Any]:
        return next(r for r in self.snapshot()["residents"] if r["name"] == name)

    def used(self, gpu: int = 0) -> int | None:
        dev = next(d for d in self.snapshot()["devices"] if d["index"] == gpu)
        used: int | None = dev["used_bytes"]
        return used

    def events(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return self.world.events(kind, **match)


@pytest.fixture
def lab(world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> Lab:
    return Lab(world, cli, monkeypatch)


def proc_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (R, S, T for stopped, Z...)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def skip_if_nvml() -> None:
    if devices.nvml_available():
        pytest.skip("this machine has NVML and a GPU: the no-driver paths cannot be seen here")


# --- 1. eviction of an idle model ------------------------------------------------------------


@pytest.mark.parametrize("main_thread", ["sleep", "busy"])
def test_idle_model_is_evicted_while_the_owners_main_thread_sleeps_or_spins(
    lab: Lab, main_thread: str
) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "m", "bytes": "6GiB"}, {"name": "keep", "bytes": "1GiB"})
    assert lab.used() == 7 * GiB
    o.send(main_thread)
    o.wait("sleeping" if main_thread == "sleep" else "spinning")

    r = lab.gpulock("evict", "m")

    assert r.code == 0, r.describe()
    assert f"m ({o.ids['m']}, pid {o.pid}, gpu0): freed: freed 6.0 GiB" in r.stdout, r.describe()
    assert o.find("unloaded", "m") == {"freed": WEIGHTS_MB * MiB, "left": 0}  # in the owner
    assert lab.names() == ["keep"]
    assert lab.used() == 1 * GiB
    (ev,) = lab.events("evict", name="m")
    assert ev["outcome"] == "freed" and ev["freed_bytes"] == 6 * GiB, ev
    # Served by the background thread: the main thread never came back from its sleep or spin.
    assert o.kinds()[-1] == "unloaded m", o.describe()
    assert not o.has("unloaded", "keep")


# --- 2. eviction during use() ----------------------------------------------------------------


def test_eviction_during_use_waits_until_the_call_returns(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "m", "bytes": "6GiB"})
    o.send("use m")
    o.wait("entered", "m")
    assert lab.resident("m")["in_use"] is True

    # The owner waits at most --timeout for the call to return, then says busy and keeps it.
    r = lab.gpulock("evict", "m", "--timeout", "0.3")
    assert r.code == 1, r.describe()
    assert ": busy: still in use" in r.stdout, r.describe()
    assert not o.has("unloaded", "m")

    evict = lab.cli.start([*GPULOCK, "evict", "m"], "evict-m")
    o.send("await-evicting m")  # the request reached the owner, which now waits for the call
    assert o.wait("evicting", "m") == {"seen": True}, o.describe()
    assert evict.popen.poll() is None, evict.output()
    assert not o.has("unloaded", "m")
    assert lab.names() == ["m"] and lab.used() == 6 * GiB

    o.send("done m")
    assert evict.wait() == 0, evict.output()
    assert ": freed: freed 6.0 GiB" in evict.out.read_text(), evict.output()
    kinds = o.kinds()
    assert kinds.index("leaving m") < kinds.index("unloaded m"), kinds
    assert lab.names() == []
    assert lab.used() == 0
    outcomes = [e["outcome"] for e in lab.events("evict", name="m")]
    assert outcomes == ["busy", "freed"]


# --- 3. an owner that does not answer --------------------------------------------------------


def test_an_owner_that_does_not_answer_is_reported_no_answer_within_a_bound(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "m", "bytes": "6GiB"})
    os.kill(o.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: proc_state(o.pid) == "T", WAIT_S, "the owner to stop")
        r = lab.gpulock("evict", "m", "--timeout", "1")
    finally:
        os.kill(o.pid, signal.SIGCONT)

    assert r.code == 1, r.describe()
    assert f": no-answer: owner pid {o.pid} did not answer in 1 s" in r.stdout, r.describe()
    # The requester waits --timeout plus 5 s for an answer (the owner's own deadline is
    # --timeout, then it needs time to unload): it answered at all while the owner stayed
    # stopped, and not before its --timeout.
    assert r.wall_s >= 1.0, r.describe()
    (ev,) = lab.events("evict", name="m")
    assert ev["outcome"] == "no-answer" and ev["pid"] == o.pid, ev
    assert ev["elapsed_s"] >= 1.0, ev
    # Continued, the owner is well: its main thread answers again.
    o.send("state m")
    o.wait("state", "m")


def test_a_request_the_requester_gave_up_on_is_not_carried_out_later(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "m", "bytes": "6GiB"}, {"name": "other", "bytes": "1GiB"})
    settings = lab.settings()
    (m,) = eviction.find(settings, "m")
    (other,) = eviction.find(settings, "other")
    idle_threads = threads(o.pid)  # main + the control socket's server
    os.kill(o.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: proc_state(o.pid) == "T", WAIT_S, "the owner to stop")
        # What eviction.evict() sends, given up on after its deadline (here 0.2 s).
        request = {"op": "evict", "id": m.id, "force": False, "timeout_s": 0.2}
        with pytest.raises(TimeoutError):
            control.ask(Registry(settings).socket_path(m.owner), request, 0.2)
    finally:
        os.kill(o.pid, signal.SIGCONT)
    # Barrier: a later request is answered (connections are accepted in order), and every
    # thread that answered one has ended.
    assert eviction.evict(settings, other).outcome == "freed"
    wait_until(lambda: threads(o.pid) == idle_threads, WAIT_S, "the answering threads to end")

    assert not o.has("unloaded", "m"), o.describe()
    assert lab.names() == ["m"]


# --- 4. a SIGKILLed owner --------------------------------------------------------------------


def test_a_sigkilled_owners_records_are_dead_and_cleaned_by_a_reader(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "a", "bytes": "4GiB"}, {"name": "b", "bytes": "2GiB"})
    settings = lab.settings()
    (a,) = eviction.find(settings, "a")
    assert lab.used() == 6 * GiB
    o.child.killpg(signal.SIGKILL)
    o.child.proc.wait(WAIT_S)

    snap = lab.snapshot()
    assert snap["residents"] == []
    assert snap["devices"][0]["used_bytes"] == 0
    assert snap["devices"][0]["free_bytes"] == 24 * GiB
    folder = lab.world.state / registry.FOLDER
    assert len(list(folder.glob("*.json"))) == 2  # status only reads: the files are still there

    assert Registry(settings).records() == []  # a reader that may clean them does
    assert sorted(os.listdir(folder)) == []  # records, claim and control socket
    cleanups = lab.events("cleanup", pid=o.pid)
    assert sorted(e["name"] for e in cleanups) == ["a", "b"], cleanups

    r = lab.gpulock("evict", "a")
    assert_clean_error(r, 1)
    assert "error: no resident model 'a'" in r.stderr, r.describe()
    assert "hint: none is registered" in r.stderr, r.describe()
    # A requester that found the record before the owner died is told so.
    res = eviction.evict(settings, a)
    assert (res.outcome, res.ok) == ("owner-gone", True), res
    assert lab.events("evict", name="a")[-1]["outcome"] == "owner-gone"


# --- 5. pinned models ------------------------------------------------------------------------


def test_pinned_model_is_refused_unless_forced(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "p", "bytes": "1GiB", "policy": "pinned"})

    r = lab.gpulock("evict", "p")
    assert r.code == 1, r.describe()
    assert ": refused: pinned (use --force)" in r.stdout, r.describe()
    assert not o.has("unloaded", "p")
    assert lab.names() == ["p"] and lab.used() == 1 * GiB

    r = lab.gpulock("evict", "p", "--force", "--json")
    assert r.code == 0, r.describe()
    (res,) = r.json()["results"]
    assert (res["outcome"], res["freed_bytes"]) == ("freed", 1 * GiB), res
    assert o.has("unloaded", "p")
    assert lab.names() == [] and lab.used() == 0
    forced = lab.events("evict", name="p", force=True)
    assert [e["outcome"] for e in forced] == ["freed"]


# --- 6. admission ----------------------------------------------------------------------------


def test_admission_counts_other_processes_residents_and_keeps_the_reserve(lab: Lab) -> None:
    lab.simulate("12GiB")
    o = lab.owner("owner", {"name": "big", "bytes": "10GiB"})
    free = 2 * GiB
    reserve = 1288490189  # 10 % of 12 GiB (rounded), above the 800 MiB floor
    assert lab.snapshot()["gpus"][0]["reserve_bytes"] == reserve

    with pytest.raises(AdmissionRefused) as refused:
        gpulock.admit("2GiB")
    e = refused.value
    assert (e.gpu, e.bytes, e.free_bytes, e.reserve_bytes) == (0, 2 * GiB, free, reserve)
    assert gpulock.admit("100MiB") == free
    assert gpulock.admit(free - reserve, gpu=0) == free  # leaves exactly the reserve
    with pytest.raises(AdmissionRefused):
        gpulock.admit(free - reserve + 1, gpu=0)  # one byte into it

    o.send("release big")
    o.wait("released", "big")
    assert gpulock.admit("2GiB") == 12 * GiB


def test_admission_reserve_is_at_least_800_mib(lab: Lab) -> None:
    lab.simulate("4GiB")  # 10 % is 410 MiB: the floor wins
    floor = eviction.MIN_ADMIT_RESERVE_BYTES
    assert floor == 800 * MiB
    assert gpulock.admit(4 * GiB - floor) == 4 * GiB
    with pytest.raises(AdmissionRefused) as refused:
        gpulock.admit(4 * GiB - floor + 1)
    assert refused.value.reserve_bytes == floor


# --- 7. room for a waiter --------------------------------------------------------------------

ROOM_RESIDENTS = (  # registered in this order: "big" is the least recently used
    {"name": "big", "bytes": "20GiB", "policy": "persistent"},
    {"name": "cold", "bytes": "2GiB", "policy": "cold-start"},
    {"name": "pin", "bytes": "1GiB", "policy": "pinned"},
)


def test_a_waiter_with_a_need_evicts_idle_models_cold_start_first_never_pinned(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", *ROOM_RESIDENTS)
    assert lab.used() == 23 * GiB

    r = lab.gpulock("run", "--need", "6GiB", "--name", "job", "--", "true")

    assert r.code == 0, r.describe()
    evicts = lab.events("evict")
    assert [e["name"] for e in evicts] == ["cold", "big"], evicts  # 1 GiB free: both needed
    for e in evicts:
        assert e["outcome"] == "freed" and e["reason"].startswith("room for ticket"), e
    (acquired,) = lab.events("acquire", name="job")
    assert acquired["ts"] >= evicts[-1]["ts"]  # room first, then the grant
    assert o.has("unloaded", "cold") and o.has("unloaded", "big")
    assert not o.has("unloaded", "pin")
    assert lab.names() == ["pin"]
    assert lab.used() == 1 * GiB


def test_a_model_in_use_is_never_evicted_to_make_room(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", *ROOM_RESIDENTS)
    o.send("use big")
    o.wait("entered", "big")

    r = lab.gpulock("run", "--need", "6GiB", "--name", "job", "--", "true")

    # Room is made from what may go (the cold-start model); the rest is short, and the job is
    # granted all the same: making room is best effort, not a condition of the grant.
    assert r.code == 0, r.describe()
    assert [(e["name"], e["outcome"]) for e in lab.events("evict")] == [("cold", "freed")]
    assert len(lab.events("acquire", name="job")) == 1
    assert not o.has("unloaded", "big") and not o.has("unloaded", "pin")
    assert lab.names() == ["big", "pin"]
    assert lab.resident("big")["in_use"] is True
    o.send("done big")
    o.wait("left", "big")
    assert lab.resident("big")["in_use"] is False


def test_an_exclusive_grant_clears_idle_residents_and_names_what_stays(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", *ROOM_RESIDENTS)
    o.send("use cold")
    o.wait("entered", "cold")

    r = lab.gpulock("run", "--name", "solo", "--", "true")  # no --need: the GPU to itself

    assert r.code == 0, r.describe()
    evicts = lab.events("evict")
    assert [(e["name"], e["outcome"]) for e in evicts] == [("big", "freed")], evicts
    assert evicts[0]["reason"].startswith("exclusive ticket"), evicts
    (acquired,) = lab.events("acquire", name="solo")
    assert acquired["ts"] >= evicts[-1]["ts"]  # room first, then the grant
    kept = {k["id"]: k["why"] for k in acquired["residents_kept"]}
    assert kept == {o.ids["cold"]: "busy", o.ids["pin"]: "pinned"}, acquired
    assert o.has("unloaded", "big") and not o.has("unloaded", "cold")
    assert lab.names() == ["cold", "pin"]
    assert lab.used() == 3 * GiB  # the memory came back, as the eviction verified


def test_exclusive_clears_residents_false_leaves_them_loaded(lab: Lab) -> None:
    lab.simulate("24GiB")
    lab.world.config.write_text("exclusive_clears_residents: false\n")
    o = lab.owner("owner", *ROOM_RESIDENTS)

    r = lab.gpulock("run", "--name", "solo", "--", "true")

    assert r.code == 0, r.describe()
    assert lab.events("evict") == []
    (acquired,) = lab.events("acquire", name="solo")
    assert "residents_kept" not in acquired
    assert not o.has("unloaded", "big")
    assert lab.names() == ["big", "cold", "pin"]


def test_the_lock_alone_makes_no_room_unless_given_a_room(lab: Lab) -> None:
    from gpulock.lock import lease, room

    lab.simulate("24GiB")
    lab.owner("owner", *ROOM_RESIDENTS)
    settings = lab.settings()
    with pytest.raises(TypeError, match="needs a Room"):
        lease.acquire(state_dir=settings.state_dir, room=None)  # type: ignore[arg-type]
    assert lab.events("acquire") == []  # refused before a ticket was taken
    with lease.acquire(state_dir=settings.state_dir, timeout=30, room=room.NO_ROOM):
        pass
    assert lab.events("evict") == []  # the bare line asks nobody to leave
    assert lab.names() == ["big", "cold", "pin"]


def test_making_room_past_an_owner_that_does_not_answer_keeps_to_the_timeout(lab: Lab) -> None:
    lab.simulate("24GiB")
    o = lab.owner("owner", *ROOM_RESIDENTS[:2])  # two idle victims, one owner
    os.kill(o.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: proc_state(o.pid) == "T", WAIT_S, "the owner to stop")
        r = lab.cli.run(
            "run", "--need", "6GiB", "--timeout", "1", "--name", "job", "--", "true", timeout_s=30
        )
    finally:
        os.kill(o.pid, signal.SIGCONT)

    # Granted (room is best effort) or timed out.  The owner was asked with what was left of
    # --timeout (1 s), not make_room's own 10 s: the event says which bound applied.
    assert r.code in (0, 75), r.describe()
    asked = [re.search(r"did not answer in ([0-9.]+) s", e["detail"]) for e in lab.events("evict")]
    assert asked and all(m is not None and float(m.group(1)) <= 1.0 for m in asked), asked


# --- 8. flush_every --------------------------------------------------------------------------


def test_flush_every_unloads_and_reloads_every_n_uses(world: World) -> None:
    loads: list[int] = []
    unloads: list[int] = []

    def load() -> dict[str, int]:
        loads.append(1)
        return {"generation": len(loads)}

    def unload(model: dict[str, int]) -> None:
        unloads.append(model["generation"])

    h = gpulock.resident("f", load=load, unload=unload, flush_every=3)
    try:
        assert (len(loads), unloads) == (1, [])
        seen = []
        for _ in range(6):
            with h.use() as model:
                seen.append(model["generation"])
        assert seen == [1, 1, 1, 2, 2, 2]
        assert (len(loads), unloads) == (3, [1, 2])
        assert (h.flushes, h.evictions, h.loaded) == (2, 0, True)
        assert [e["uses"] for e in world.events("flush", name="f")] == [3, 6]
        (rec,) = Registry(world.settings()).records()
        assert (rec.id, rec.uses, rec.in_use, rec.flush_every) == (h.id, 6, False, 3)
    finally:
        h.release()
    assert unloads == [1, 2, 3]
    assert Registry(world.settings()).records() == []


def test_flush_every_needs_load_and_a_whole_number(world: World) -> None:
    with pytest.raises(ValueError, match="load="):
        gpulock.resident("f", model=object(), unload=lambda m: None, flush_every=3)
    with pytest.raises(ValueError, match=">= 1"):
        gpulock.resident("f", load=object, unload=lambda m: None, flush_every=0)
    assert Registry(world.settings()).records() == []


# --- 9. reload after an eviction -------------------------------------------------------------


def test_an_evicted_resident_reloads_on_next_use_through_load(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(devices.SIMULATE_ENV, "24GiB")
    settings = world.settings()
    models: list[object] = []
    unloaded: list[object] = []

    def load() -> object:
        models.append(object())
        return models[-1]

    h = gpulock.resident("r", bytes="1GiB", load=load, unload=unloaded.append)
    try:
        h.update(measured_bytes=2 * GiB)  # measured wins over declared
        assert registry.used_bytes(settings, 0) == 2 * GiB

        # Asked through this process's own control socket, served by its background thread.
        results = gpulock.evict("r", timeout=5)

        assert [(x.outcome, x.freed_bytes) for x in results] == [("freed", 2 * GiB)]
        assert (h.loaded, h.evictions, unloaded) == (False, 1, [models[0]])
        assert Registry(settings).records() == []
        with h.use() as model:
            assert model is models[1]  # load() ran again
        assert (len(models), h.loaded) == (2, True)
        assert [r.id for r in Registry(settings).records()] == [h.id]
        assert registry.used_bytes(settings, 0) == 2 * GiB
    finally:
        h.release()


def test_an_evicted_resident_without_load_raises_evicted(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(devices.SIMULATE_ENV, "24GiB")
    unloaded: list[object] = []
    model = object()
    h = gpulock.resident("n", bytes="1GiB", model=model, unload=unloaded.append)
    try:
        (res,) = gpulock.evict("n", timeout=5)
        assert res.outcome == "freed" and unloaded == [model]
        with pytest.raises(Evicted, match="'n' was evicted"), h.use():
            pass
        assert Registry(world.settings()).records() == []
    finally:
        h.release()


# --- 10. adapters ----------------------------------------------------------------------------


def test_unload_llama_calls_close() -> None:
    class FakeLlama:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    llm = FakeLlama()
    assert adapters.unload_llama(llm) is None
    assert llm.closed == 1
    adapters.unload_llama(object())  # nothing to close: nothing done, no error


def test_unload_torch_moves_a_module_like_object_to_the_cpu() -> None:
    class Module:
        def __init__(self) -> None:
            self.moved: list[str] = []

        def to(self, device: str) -> None:
            self.moved.append(device)

    m = Module()
    result = adapters.unload_torch(m)
    assert m.moved == ["cpu"]
    if devices.torch_memory(0) is None:  # no torch, or no CUDA device
        assert result is None


def test_unload_torch_on_a_cpu_torch_module() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (the 'torch' extra)")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: this test is about a CPU-only torch")
    layer = torch.nn.Linear(4, 2)
    assert adapters.unload_torch(layer) is None
    assert layer.weight.device.type == "cpu"


# --- 11. a real llama.cpp model --------------------------------------------------------------


def test_a_real_llama_cpp_model_is_used_then_unloaded_by_eviction(lab: Lab, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("gguf", reason="gguf is not installed (needed to write the tiny model)")
    from gpulock.router.tiny_model import ensure_tiny_llama

    path = ensure_tiny_llama(tmp_path / "models")
    lab.simulate("24GiB")
    o = lab.owner("owner", {"name": "tiny", "bytes": "512MiB", "llama": str(path)})
    o.send("use tiny")
    o.wait("entered", "tiny")
    o.send("complete tiny")
    usage = o.wait("completed", "tiny")["usage"]
    assert usage["completion_tokens"] >= 1, usage
    o.send("done tiny")
    o.wait("left", "tiny")
    assert lab.resident("tiny")["uses"] == 1

    r = lab.gpulock("evict", "tiny")

    assert r.code == 0, r.describe()
    assert ": freed: freed 512 MiB" in r.stdout, r.describe()
    assert o.find("unloaded", "tiny") == {"closed": True, "model_freed": True}, o.describe()
    assert lab.names() == []
    assert lab.used() == 0


# --- 12. no NVML -----------------------------------------------------------------------------


def test_without_nvml_status_prints_cleanly_and_evict_cannot_verify(lab: Lab) -> None:
    skip_if_nvml()
    lab.simulate(None)
    o = lab.owner("owner", {"name": "m", "bytes": "1GiB"})

    r = lab.gpulock("status")
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert r.stdout.startswith("devices: no NVIDIA driver"), r.describe()
    # A shell without the tour's variable (another terminal) learns what it lacks.
    assert "GPULOCK_SIMULATE=24GiB pretends one" in r.stdout.splitlines()[0], r.describe()
    r = lab.gpulock("status", "--json")
    assert (r.code, r.stderr) == (0, ""), r.describe()
    snap = r.json()
    assert snap["devices"] == [] and snap["gpus"] == []
    assert snap["devices_problem"].startswith("no NVIDIA driver"), snap
    assert [x["name"] for x in snap["residents"]] == ["m"]
    assert gpulock.admit("1TiB") is None  # nothing known: nothing checked

    r = lab.gpulock("evict", "m", "--json")
    assert r.code == 0, r.describe()
    (res,) = r.json()["results"]
    assert res["outcome"] == "unloaded", res
    assert res["detail"] == "unloaded; no memory probe to verify"
    assert res["freed_bytes"] is None, res  # nothing verified it: not counted as freed
    (e,) = [x for x in read_events(lab.settings().state_dir) if x["event"] == "evict"]
    assert e["freed_bytes"] is None and e["declared_bytes"] == 1024**3, e
    assert o.has("unloaded", "m")


def test_without_nvml_human_status_still_lists_resident_models(lab: Lab) -> None:
    skip_if_nvml()
    lab.simulate(None)
    o = lab.owner("owner", {"name": "qwen", "bytes": "1GiB"})

    r = lab.gpulock("status")

    assert r.code == 0, r.describe()
    assert "resident models" in r.stdout, r.describe()
    assert o.ids["qwen"] in r.stdout, r.describe()


def test_report_torch_is_a_quiet_no_op_without_cuda(world: Any) -> None:
    """Without CUDA there is nothing to publish: no error, and the record keeps None."""
    h = gpulock.resident("t", bytes="1GiB", unload=lambda: None)
    try:
        assert h.report_torch() is None
        assert h.record.torch_reserved_bytes is None
    finally:
        h.release()


@pytest.mark.parametrize("answer", [b"", b"not json\n", b"[1, 2]\n"])
def test_an_owner_that_hangs_up_or_mumbles_is_a_failed_connection_not_a_crash(
    tmp_path: Path, answer: bytes
) -> None:
    # Seen in the demo: an owner exiting while a waiter asked it to evict closed the socket
    # without a word, and the waiter's json.loads(b"") crashed the agent that was waiting.
    import threading

    path = tmp_path / "owner.sock"
    server = control.listen(path)

    def owner() -> None:
        conn, _ = server.accept()
        with conn:
            control.recv_line(conn)
            conn.sendall(answer)

    t = threading.Thread(target=owner)
    t.start()
    try:
        with pytest.raises(OSError):
            control.ask(path, {"op": "evict", "id": "x"}, timeout_s=5)
    finally:
        t.join(5)
        server.close()
