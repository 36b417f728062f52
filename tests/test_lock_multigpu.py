"""Several GPUs, one line, with real processes: ``gpu="any"``, sets, ``gpus=2`` (issue 28).

Every contender is a real child process (tests/procs.py) on a simulated host of two to four
GPUs; holds are audited per GPU, kills are SIGKILL, and waits poll a condition with a deadline.
The waiters' timed safety re-check is pushed past every deadline, so a handoff seen here is a
kernel wake-up.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from procs import DEFAULT_WAIT_S, Child, World, intervals, overlapping, wait_until

from gpulock.lock.ticket import fifo_name, file_name

NO_SAFETY_RECHECK = "3600"


@pytest.fixture(autouse=True)
def kernel_wakeups_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULOCK_SAFETY_RECHECK_S", NO_SAFETY_RECHECK)


def host(world: World, n: int = 2) -> World:
    """``n`` simulated 24 GiB GPUs for the children (they read the world's config file)."""
    world.config.write_text("simulate: " + ",".join(["24GiB"] * n) + "\n")
    return world


def granted(world: World, name: str) -> list[int]:
    return list(world.wait_record("grant", name).extra["gpus"])


def assert_no_overlap(world: World, killed: dict[str, int] | None = None) -> None:
    pairs = overlapping(intervals(world.records(), killed))
    assert not pairs, f"two holders of one GPU at once: {pairs}\n{world.describe()}"


def leftovers(world: World, seq: int, gpus: range) -> list[str]:
    """The files of ticket ``seq`` still in any GPU's folder."""
    out = []
    for g in gpus:
        d = world.gpu_dir(g)
        out += [f"gpu{g}/{n}" for n in (file_name(seq), fifo_name(seq)) if (d / n).exists()]
    return out


def not_granted(world: World, child: Child) -> None:
    """``child`` decided to wait (its wait event is written) and holds nothing."""
    wait_until(
        lambda: world.events("wait", ticket=child.seq),
        DEFAULT_WAIT_S,
        lambda: f"{child.name} to decide to wait\n{world.describe()}",
    )
    assert world.find_record("grant", child.name) is None, world.describe()


def test_any_is_granted_the_idle_gpu_while_gpu0_is_held(world: World) -> None:
    host(world)
    world.hold("h0", gpu=0)
    world.enqueue("a", gpu="any")
    assert granted(world, "a") == [1]
    rec = world.find_record("grant", "a")
    assert rec is not None and rec.extra["cuda"] == "1"
    assert_no_overlap(world)


def test_a_set_waits_in_each_line_and_is_granted_where_a_holder_leaves(world: World) -> None:
    host(world, 3)
    h0 = world.hold("h0", gpu=0)
    world.hold("h2", gpu=2)
    world.hold("h1", gpu=1)
    a = world.enqueue("a", gpu=[0, 2])
    not_granted(world, a)
    for g in (0, 2):  # a copy in the line of each GPU of its set, none in gpu1's
        assert a.seq in world.tickets(g)
    assert a.seq not in world.tickets(1)
    h0.release()
    assert granted(world, "a") == [0]
    wait_until(lambda: a.seq not in world.tickets(2), DEFAULT_WAIT_S, "its gpu2 copy to leave")
    t = world.tickets(0)[a.seq]
    assert (t.gpus, t.granted_gpus) == ((0, 2), (0,))
    assert_no_overlap(world)


def test_fifo_across_the_set_an_earlier_any_takes_the_gpu_a_later_pinned_one_wanted(
    world: World,
) -> None:
    host(world)
    h0 = world.hold("h0", gpu=0)
    h1 = world.hold("h1", gpu=1)
    a = world.enqueue("a", gpu="any")  # earlier
    b = world.enqueue("b", gpu=1)  # later, pinned to the GPU that frees first
    not_granted(world, a)
    not_granted(world, b)
    h1.release()
    assert granted(world, "a") == [1]  # not b: a came first and could take gpu1
    not_granted(world, b)
    h0.release()  # gpu0 frees: b wants gpu1 only, which a holds
    a.release()
    assert granted(world, "b") == [1]
    order = [r.name for r in world.records() if r.kind == "grant"]
    assert order == ["h0", "h1", "a", "b"]
    assert_no_overlap(world)


def test_a_two_gpu_job_holds_none_until_both_and_is_not_starved(world: World) -> None:
    host(world)
    h0 = world.hold("h0", gpu=0)
    m = world.enqueue("m", gpu="any", gpus=2)
    not_granted(world, m)
    # gpu1 is idle, yet it is not taken piecemeal, and later one-GPU jobs do not pass m there.
    assert not world.tickets(1)[m.seq].holding
    stream = [world.enqueue(f"p{i}", gpu=1) for i in range(3)]
    for p in stream:
        not_granted(world, p)
    h0.release()
    assert sorted(granted(world, "m")) == [0, 1]
    rec = world.find_record("grant", "m")
    assert rec is not None and rec.extra["cuda"] == "0,1"
    m.release()
    for p in stream:
        assert granted(world, p.name) == [1]
        p.release()
    order = [r.name for r in world.records() if r.kind == "grant"]
    assert order == ["h0", "m", "p0", "p1", "p2"]
    assert_no_overlap(world)


def test_two_gpu_jobs_asking_in_any_order_never_deadlock(world: World) -> None:
    """Taking two locks one after the other deadlocks against a job taking them in the other
    order; two-GPU tickets take both at once or none."""
    host(world, 3)
    h = [world.hold(f"h{g}", gpu=g) for g in range(3)]
    m1 = world.enqueue("m1", gpu=[0, 1], gpus=2)
    m2 = world.enqueue("m2", gpu=[1, 0], gpus=2)
    m3 = world.enqueue("m3", gpu=[2, 1], gpus=2)
    for m in (m1, m2, m3):
        not_granted(world, m)
    h[1].release()
    h[0].release()
    assert sorted(granted(world, "m1")) == [0, 1]
    h[2].release()
    m1.release()
    assert sorted(granted(world, "m2")) == [0, 1]
    m2.release()
    assert sorted(granted(world, "m3")) == [1, 2]
    m3.release()
    assert_no_overlap(world)


def test_a_sigkilled_two_gpu_holder_frees_both_gpus(world: World) -> None:
    host(world)
    m = world.enqueue("m", gpu="any", gpus=2)
    assert sorted(granted(world, "m")) == [0, 1]
    w0 = world.enqueue("w0", gpu=0)
    w1 = world.enqueue("w1", gpu=1)
    not_granted(world, w0)
    not_granted(world, w1)
    m.killpg(signal.SIGKILL)
    assert granted(world, "w0") == [0]
    assert granted(world, "w1") == [1]
    w0.release()
    w1.release()
    assert w0.wait_exit() == 0 and w1.wait_exit() == 0
    assert m.seq is not None and not leftovers(world, m.seq, range(2)), world.describe()
    assert_no_overlap(world, killed={"m": 0})


def test_a_dead_any_waiter_is_cleaned_in_every_line(world: World) -> None:
    host(world, 3)
    holders = [world.hold(f"h{g}", gpu=g) for g in range(3)]
    a = world.enqueue("a", gpu="any")
    not_granted(world, a)
    b = world.enqueue("b", gpu=2)
    not_granted(world, b)
    a.killpg(signal.SIGKILL)
    assert a.wait_exit() != 0
    holders[2].release()  # b wakes, finds a dead ahead of it, removes every copy of it
    assert granted(world, "b") == [2]
    assert a.seq is not None
    wait_until(
        lambda: not leftovers(world, a.seq or 0, range(3)),
        DEFAULT_WAIT_S,
        lambda: f"a's copies to be cleaned\n{world.describe()}",
    )
    cleaned = {e["gpu"] for e in world.events("cleanup", ticket=a.seq)}
    assert cleaned == {0, 1, 2}


def test_an_any_waiter_that_times_out_leaves_every_line(world: World) -> None:
    host(world)
    world.hold("h0", gpu=0)
    world.hold("h1", gpu=1)
    a = world.enqueue("a", gpu="any", timeout=1.0)
    world.wait_record("timeout", "a")
    assert a.wait_exit() == 3
    assert a.seq is not None and not leftovers(world, a.seq, range(2))
    ev = world.wait_event("timeout", ticket=a.seq)
    assert ev["gpus"] == [0, 1] and ev["granted"] == []


def test_sharing_by_memory_across_the_set(world: World) -> None:
    host(world)
    world.hold("big0", gpu=0, need="16GiB")
    world.hold("big1", gpu=1, need="12GiB")
    # 8 GiB fits only beside the 12 GiB job (21.6 GiB budget each): gpu1, though gpu0 is first.
    world.enqueue("s", gpu="any", need="8GiB")
    assert granted(world, "s") == [1]


def test_a_set_never_holds_back_a_gpu_outside_it(world: World) -> None:
    """A waiting set ticket stands only in the lines of its set: gpu1 is not held back."""
    host(world, 3)
    world.hold("h0", gpu=0)
    world.hold("h2", gpu=2)
    s = world.enqueue("s", gpu=[0, 2])
    not_granted(world, s)
    world.enqueue("p1", gpu=1)
    assert granted(world, "p1") == [1]


def test_nested_acquire_inside_a_two_gpu_lease_is_covered_by_it(world: World) -> None:
    host(world)
    n = world.enqueue("n", gpu="any", gpus=2, mode="nested")
    rec = world.wait_record("nested", "n")
    assert rec.extra["same"] is True
    n.release()
    n.send("done")
    assert n.wait_exit() == 0


def test_status_shows_an_any_waiter_once_and_a_two_gpu_holder_on_each(world: World) -> None:
    host(world)
    world.enqueue("m", gpu="any", gpus=2)
    granted(world, "m")
    a = world.enqueue("a", gpu="any")
    not_granted(world, a)
    snap = world.snapshot()
    by_gpu = {g["gpu"]: g for g in snap["gpus"]}
    for g in (0, 1):
        (h,) = by_gpu[g]["holders"]
        assert (h["name"], h["gpus"], sorted(h["granted"])) == ("m", 2, [0, 1])
        assert by_gpu[g]["waiters"] == []  # the set's waiter is shown under its set
    (line,) = snap["sets"]
    assert line["gpus"] == [0, 1]
    (w,) = line["waiters"]
    assert (w["name"], w["gpus"], w["granted"], w["state"]) == ("a", [0, 1], [], "waiting")
    from gpulock import status

    text = status.render(snap)
    assert text.count(" a ") + text.count(" a\n") >= 1
    assert sum(1 for ln in text.splitlines() if f"  {a.seq}  " in ln) == 1


def test_break_of_a_two_gpu_ticket_removes_every_copy(world: World, tmp_path: Path) -> None:
    host(world)
    m = world.enqueue("m", gpu="any", gpus=2)
    granted(world, "m")
    m.killpg(signal.SIGSTOP)  # hung, from the outside: --force ends it
    try:
        from gpulock.lock import repair

        result = repair.break_ticket(world.settings(), m.seq or 0, force=True, grace_s=0.5)
        assert result.action == "killed"
    finally:
        m.killpg(signal.SIGCONT)
    assert m.seq is not None and not leftovers(world, m.seq, range(2)), world.describe()
    assert os.path.isdir(world.gpu_dir(1))


def test_placed_where_its_model_is_resident_then_where_most_memory_is_free(
    world: World, tmp_path: Path
) -> None:
    """Among GPUs that can grant at once: the one where the job's model (its --prefetch file)
    is resident first, then the most free memory."""
    import gpulock

    host(world, 3)
    model = tmp_path / "qwen-7b.gguf"
    model.write_bytes(b"GGUF" + bytes(4096))
    settings = world.settings()
    h = gpulock.resident(
        "qwen-7b", gpu=2, bytes="5GiB", model=object(), unload=lambda m: None,
        config=str(world.config), state_dir=world.state,
    )  # fmt: skip
    try:
        world.enqueue("warm", gpu="any", need="4GiB", prefetch=[str(model)])
        assert granted(world, "warm") == [2]
        ev = world.wait_event("acquire", name="warm")
        assert ev["granted"] == [2]
    finally:
        h.release()
    assert settings.state_dir == world.state
    # No model resident: the most free memory (gpu0 holds 12 GiB, gpu1 8, gpu2 4 of 21.6).
    world.hold("b0", gpu=0, need="12GiB")
    world.hold("b1", gpu=1, need="8GiB")
    world.enqueue("free", gpu="any", need="2GiB")
    assert granted(world, "free") == [2]
    world.enqueue("free2", gpu=[0, 1], need="2GiB")
    assert granted(world, "free2") == [1]


def test_prefer_names_where_the_caller_knows_it_is_warm(world: World) -> None:
    host(world, 3)
    world.enqueue("p", gpu="any", need="2GiB", prefer=[1])
    assert granted(world, "p") == [1]
