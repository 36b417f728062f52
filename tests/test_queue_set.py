"""Table tests of the rule for several GPUs, one line (gpulock.lock.queue.decide_set).

No files, no processes: tickets are records, a line is the tickets ahead of a ticket in one
GPU's folder.  Besides the tables, every small world of pinned, ``any`` and two-GPU tickets on
three GPUs is checked against the promises of docs/lock.md (FIFO across the set, all or
nothing, no sharing past the budget), and a long random run checks that nobody waits for ever.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from gpulock.lock.queue import decide, decide_set, place
from gpulock.lock.ticket import Ticket

GIB = 1024**3
BUDGET = 22 * GIB  # a 24 GiB GPU less a 2 GiB reserve
FOUR = (0, 1, 2, 3)


def t(
    seq: int,
    gpus: Sequence[int] = (0,),
    count: int = 1,
    need_gib: float | None = None,
    *,
    held: Sequence[int] = (),
) -> Ticket:
    """Ticket ``seq`` for ``count`` of ``gpus``; ``held``: the GPUs it holds (granted)."""
    return Ticket(
        seq=seq,
        gpu=held[0] if held else gpus[0],
        pid=1000 + seq,
        uid=1000,
        user="agent",
        host="box",
        name=f"job{seq}",
        created_wall=50.0,
        need_bytes=None if need_gib is None else int(need_gib * GIB),
        granted_wall=100.0 if held else None,
        gpus=tuple(gpus) if len(gpus) > 1 or count > 1 else (),
        count=count,
        granted_gpus=tuple(held) if held and (len(gpus) > 1 or count > 1) else (),
    )


def lines_of(me: Ticket, world: Sequence[Ticket]) -> dict[int, list[Ticket]]:
    """Each GPU of ``me``'s set: the tickets ahead of it in that GPU's folder (a waiter has a
    copy in every line of its set, a holder only in the lines of the GPUs it holds)."""
    return {
        g: [u for u in world if u.seq < me.seq and g in (u.held_gpus or u.gpu_set)]
        for g in me.gpu_set
    }


def budgets(gpus: Sequence[int] = FOUR) -> dict[int, int | None]:
    return dict.fromkeys(gpus, BUDGET)


def judge(me: Ticket, world: Sequence[Ticket], **kw: object):  # type: ignore[no-untyped-def]
    return decide_set(me, lines_of(me, world), budgets(), **kw)  # type: ignore[arg-type]


# (the world ahead, the newcomer) -> (GPUs granted, watched (gpu, seq))
SET_TABLE = [
    pytest.param([], t(9, FOUR), (0,), (), id="any, all idle: the lowest"),
    pytest.param([t(1, held=[0])], t(9, FOUR), (1,), (), id="any: the first idle one"),
    pytest.param(
        [t(1, held=[0]), t(2, [1], held=[1]), t(3, [2], held=[2]), t(4, [3], held=[3])],
        t(9, FOUR),
        (),
        ((0, 1), (1, 2), (2, 3), (3, 4)),
        id="any, all busy: watches every holder",
    ),
    pytest.param(
        [t(1, [0], need_gib=6, held=[0]), t(2, [1], held=[1])],
        t(9, (0, 1), need_gib=6),
        (0,),
        (),
        id="any with a need: shares a GPU that has room",
    ),
    pytest.param(
        [t(1, [0], need_gib=18, held=[0]), t(2, [1], held=[1])],
        t(9, (0, 1), need_gib=6),
        (),
        ((0, 1), (1, 2)),
        id="any with a need: no room anywhere",
    ),
    pytest.param(
        [t(1, [0], held=[0]), t(2, [0])],
        t(9, (0, 1)),
        (1,),
        (),
        id="any: a pinned waiter on gpu0 does not hold gpu1 back",
    ),
    pytest.param(
        [t(1, [0], held=[0]), t(2, [1], held=[1]), t(3, (0, 1))],
        t(9, (0, 1)),
        (),
        ((0, 3), (1, 3)),
        id="any behind an earlier any: watches its copies",
    ),
    pytest.param(
        [t(1, [0], held=[0]), t(5, FOUR)],
        t(9, [2]),
        (),
        ((2, 5),),
        id="pinned behind a waiting any: FIFO on its GPU",
    ),
    pytest.param([], t(9, FOUR, 2), (0, 1), (), id="two GPUs, all idle"),
    pytest.param(
        [t(1, [0], held=[0]), t(2, [2], held=[2])],
        t(9, FOUR, 2),
        (1, 3),
        (),
        id="two GPUs: the two idle ones",
    ),
    pytest.param(
        [t(1, [0], held=[0]), t(2, [1], held=[1]), t(3, [2], held=[2])],
        t(9, FOUR, 2),
        (),
        ((0, 1), (1, 2), (2, 3)),
        id="two GPUs, one idle: holds none, watches the holders",
    ),
    pytest.param(
        [t(1, [0], held=[0]), t(2, [1], held=[1]), t(3, [2], held=[2]), t(4, FOUR, 2)],
        t(9, [3]),
        (),
        ((3, 4),),
        id="a waiting two-GPU job holds back the idle GPU",
    ),
    pytest.param(
        [t(1, FOUR, 2, held=[1, 2])],
        t(9, FOUR, 2),
        (0, 3),
        (),
        id="beside a two-GPU holder",
    ),
    pytest.param(
        [t(1, FOUR, 2, held=[1, 2])],
        t(9, [2]),
        (),
        ((2, 1),),
        id="pinned behind a two-GPU holder",
    ),
    pytest.param(
        [t(1, (0, 1), 2), t(2, (1, 2), 2)],
        t(9, (2, 3), 2),
        (),
        ((2, 2),),
        id="chain of two-GPU waiters: only the nearest on each line",
    ),
]


@pytest.mark.parametrize(("world", "me", "grant", "watch"), SET_TABLE)
def test_decide_set(
    world: list[Ticket], me: Ticket, grant: tuple[int, ...], watch: tuple[tuple[int, int], ...]
) -> None:
    d = judge(me, world)
    assert (d.grant, d.watch) == (grant, watch), d.reason
    assert d.reason


def test_a_pinned_ticket_is_decided_as_by_the_one_gpu_rule() -> None:
    """One GPU: the set rule and ``decide`` agree on every small queue (grant and watch)."""
    kinds = [t(0, held=[0]), t(0, [0], 1, 6, held=[0]), t(0), t(0, need_gib=6)]
    for n in range(4):
        for combo in itertools.product(kinds, repeat=n):
            ahead = [replace(k, seq=i + 1) for i, k in enumerate(combo)]
            for me in (t(9), t(9, need_gib=6), t(9, need_gib=16)):
                one = decide(me, ahead, BUDGET)
                many = decide_set(me, {0: ahead}, {0: BUDGET})
                assert (one.grant, one.watch) == (bool(many.grant), tuple(s for _, s in many.watch))


def test_the_reasons_say_what_waits_for_what() -> None:
    world = [t(1, [0], held=[0]), t(2, [1], held=[1]), t(3, [2], held=[2])]
    d = judge(t(9, FOUR, 2), world)
    assert d.reason.startswith("needs 2 GPUs at once, 1 ready (gpu3); gpu0: exclusive")
    assert judge(t(9, FOUR), world).reason == "gpu3: first in line"
    d = judge(t(9, FOUR, 2), [t(1, [0], held=[0])], warm={2: "qwen resident"})
    assert d.grant == (1, 2) and d.reason.endswith("(warm: qwen resident)")


def test_a_blocked_gpu_is_not_taken_but_the_others_are() -> None:
    world = [t(1, [0], held=[0])]
    d = judge(t(9, (1, 2)), world, blocked={1: "holder 4 died: waiting for its processes"})
    assert d.grant == (2,)
    d = judge(t(9, [1]), world, blocked={1: "holder 4 died"})
    assert d.grant == () and d.watch == () and "died" in d.reason  # the exit watch wakes it


PLACE_TABLE = [
    pytest.param((0, 1, 2), 1, {}, {}, (0,), id="nothing known: the lowest"),
    pytest.param((0, 1, 2), 1, {2: "m"}, {0: 20 * GIB}, (2,), id="warm beats free memory"),
    pytest.param((0, 1, 2), 1, {}, {0: 4 * GIB, 1: 20 * GIB}, (1,), id="the most free memory"),
    pytest.param((0, 1, 2), 1, {}, {0: None, 2: 1}, (2,), id="unknown free counts last"),
    pytest.param((0, 1, 2, 3), 2, {3: "m"}, {1: 9, 2: 5}, (1, 3), id="two: warm, then free"),
    pytest.param((3, 1), 2, {}, {}, (1, 3), id="as many as ready: all, ascending"),
]


@pytest.mark.parametrize(("ready", "count", "warm", "free", "pick"), PLACE_TABLE)
def test_place(
    ready: tuple[int, ...],
    count: int,
    warm: dict[int, str],
    free: dict[int, int | None],
    pick: tuple[int, ...],
) -> None:
    assert place(ready, count, warm, free)[0] == pick


# --- every small world ---------------------------------------------------------------------

THREE = (0, 1, 2)
# What a ticket may be on three GPUs: pinned (exclusive or 8 GiB), any, a pair, two of three.
_ASKS = [((0,), 1, None), ((1,), 1, 8), (THREE, 1, None), ((0, 1), 1, 8), (THREE, 2, None)]


def _fits(holders: list[Ticket], me: Ticket, budget: int) -> bool:
    if me.exclusive:
        return not holders
    return not any(h.exclusive for h in holders) and (
        sum(h.need_bytes or 0 for h in holders) + (me.need_bytes or 0) <= budget
    )


def _worlds() -> list[list[Ticket]]:
    """Up to three tickets, each waiting or holding some GPUs of its set, where the holders
    are a state the rule could have made: no GPU over its budget or shared exclusively."""
    out: list[list[Ticket]] = []
    for n in range(4):
        for asks in itertools.product(_ASKS, repeat=n):
            options = []
            for gpus, count, _need in asks:
                opts: list[tuple[int, ...]] = [()]
                opts += list(itertools.combinations(gpus, count))
                options.append(opts)
            for helds in itertools.product(*options):
                world = [
                    t(i + 1, gpus, count, need, held=held)
                    for i, ((gpus, count, need), held) in enumerate(zip(asks, helds, strict=True))
                ]
                ok = True
                for g in THREE:
                    on = [u for u in world if g in u.held_gpus]
                    for i, u in enumerate(on):
                        if not _fits(on[:i], u, BUDGET):
                            ok = False
                if ok:
                    out.append(world)
    return out


def test_fifo_across_the_set_over_every_small_world() -> None:
    """No ticket is granted a GPU that an earlier waiting ticket could have taken at that
    moment; all or nothing; within each GPU's budget; a refused ticket always watches
    something that can change its answer."""
    checked = 0
    for world in _worlds():
        for gpus, count, need in _ASKS:
            me = t(9, gpus, count, need)
            d = decide_set(me, lines_of(me, world), budgets(THREE))
            if d.grant:
                assert len(d.grant) == count and set(d.grant) <= set(gpus), d
                assert d.watch == ()
                for g in d.grant:
                    assert _fits([u for u in world if g in u.held_gpus], me, BUDGET), d
                    for e in world:  # FIFO across the set
                        if e.holding or g not in e.gpu_set:
                            continue
                        ahead = lines_of(e, world)[g]
                        could = decide(e, ahead, BUDGET).grant
                        assert not could, f"ticket 9 took gpu{g}, which waiting {e.seq} could"
                        raise AssertionError(f"ticket 9 overtook waiting {e.seq} on gpu{g}")
            else:
                assert d.watch, f"refused but watches nothing: it would never wake ({d.reason})"
                for g, s in d.watch:
                    assert g in gpus and any(u.seq == s for u in lines_of(me, world)[g])
            checked += 1
    assert checked > 5000


# --- a long random run: the line always moves, and nobody starves -------------------------


def _settle(world: list[Ticket], overtaken: list[str]) -> int:
    """Every waiter that may is granted, in ticket order, until the world is still (as their
    wake-ups would); a later ticket granted a GPU of an earlier waiter's set is noted."""
    grants = 0
    changed = True
    while changed:
        changed = False
        for i, me in enumerate(world):
            if me.holding:
                continue
            d = decide_set(me, lines_of(me, world), budgets())
            if not d.grant:
                assert d.watch
                continue
            for e in world[:i]:
                if not e.holding and set(e.gpu_set) & set(d.grant):
                    overtaken.append(f"{me.seq} took {d.grant} before {e.seq} ({e.gpu_set})")
            world[i] = replace(
                me, gpu=d.grant[0], granted_wall=1.0, granted_gpus=d.grant if me.spans else ()
            )
            grants += 1
            changed = True
    return grants


def _run(seed: int, steps: int = 3000) -> tuple[int, list[str], list[Ticket]]:
    """Arrivals and releases at random on four GPUs, then no more arrivals until every holder
    has left.  Returns the grants, the overtakings, and what is left (nothing, or a wedge)."""
    rng = random.Random(seed)
    world: list[Ticket] = []
    overtaken: list[str] = []
    seq = grants = 0
    asks = [((0,), 1), ((1,), 1), ((2,), 1), ((3,), 1), (FOUR, 1), ((0, 2), 1), (FOUR, 2)]
    for step in range(steps * 2):
        holders = [u for u in world if u.holding]
        if holders and (step >= steps or rng.random() < 0.5):
            world.remove(rng.choice(holders))
        elif step < steps and len(world) < 24:
            seq += 1
            gpus, count = rng.choice(asks)
            world.append(t(seq, gpus, count, rng.choice([None, 6, 10])))
        grants += _settle(world, overtaken)
        first = next((u for u in world if not u.holding), None)
        if first is not None:  # the earliest waiter only ever waits for holders: no deadlock
            for ahead in lines_of(first, world).values():
                assert all(u.holding for u in ahead)
            assert any(u.holding for u in world), "waiters and no holder: a wedge"
    return grants, overtaken, world


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_runs_never_overtake_never_wedge_and_end_empty(seed: int) -> None:
    grants, overtaken, left = _run(seed)
    assert grants > 1000
    assert not overtaken  # not even a two-GPU job is passed on a GPU of its set
    assert not left  # every waiter, two-GPU ones included, was granted in the end


# --- the on-disk form ---------------------------------------------------------------------


def test_a_pinned_ticket_file_is_what_it_was_before_sets() -> None:
    import json

    from gpulock.lock.ticket import encode

    body = json.loads(encode(t(4, need_gib=6)))
    assert body["format"] == "gpulock.ticket/1"
    assert not {"gpus", "count", "granted_gpus"} & set(body)
    assert list(body) == [
        "format", "seq", "gpu", "pid", "uid", "user", "host", "name", "created_wall",
        "start_ticks", "boot_id", "pidns", "command", "need_bytes", "lease_s", "granted_wall",
        "child_pid", "child_start_ticks",
    ]  # fmt: skip


def test_a_set_ticket_round_trips_and_an_older_reader_sees_an_ordinary_ticket() -> None:
    import json

    from gpulock.lock.ticket import encode, parse

    held = t(7, FOUR, 2, 6, held=[1, 3])
    assert parse(encode(held)) == held
    waiting = t(8, FOUR)
    assert parse(encode(waiting)) == waiting
    # A reader that knows nothing of sets ignores the three keys it does not know: what it
    # reads is a ticket of that copy's GPU, holding or waiting, as it stands in that line.
    body = json.loads(encode(held))
    old = {k: v for k, v in body.items() if k not in ("gpus", "count", "granted_gpus")}
    seen = parse(json.dumps(old).encode())
    assert (seen.gpu, seen.holding, seen.need_bytes, seen.spans) == (1, True, 6 * GIB, False)


@pytest.mark.parametrize(
    "change",
    [
        {"gpus": [1, 2]},  # its own GPU (0) is not in its set
        {"gpus": [0, 0, 1]},
        {"gpus": []},
        {"gpus": [0, -1]},
        {"gpus": "0,1"},
        {"gpus": [0, 1], "count": 3},
        {"count": 0},
        {"count": True},
        {"gpus": [0, 1], "granted_gpus": [0]},  # granted, but not marked granted
    ],
)
def test_a_set_ticket_with_bad_set_keys_is_garbage(change: dict[str, object]) -> None:
    import json

    from gpulock.lock.ticket import TicketFormatError, encode, parse

    body = json.loads(encode(t(3)))
    body.update(change)
    with pytest.raises(TicketFormatError):
        parse(json.dumps(body).encode())
