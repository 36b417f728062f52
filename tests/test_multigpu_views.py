"""A multi-GPU ticket as the views of the event log see it (issue 28): history's GPU column
and ``--gpu``, the metrics' counters and the report's holds, each once per GPU it is about
and counted once as a ticket.  Pure: made-up events, as the lock writes them."""

from __future__ import annotations

from typing import Any

import pytest

from gpulock.report import build

T0 = 1_795_000_000.0


def ev(t: float, kind: str, gpu: int, ticket: int, name: str, **f: Any) -> dict[str, Any]:
    return {"ts": T0 + t, "event": kind, "gpu": gpu, "ticket": ticket, "pid": 100 + ticket,
            "name": name, "need_bytes": None, **f}  # fmt: skip


# ticket 7: two GPUs of four at once; ticket 8: any of 0-1, gave up; ticket 9: pinned to gpu1
EVENTS = [
    ev(0, "wait", 0, 7, "train", gpus=2, gpu_set=[0, 1, 2, 3], granted=[], reason="r"),
    ev(5, "acquire", 0, 7, "train", gpus=2, gpu_set=[0, 1, 2, 3], granted=[0, 2], waited_s=5.0),
    ev(6, "wait", 0, 8, "embed", gpus=[0, 1], granted=[], reason="r"),
    ev(7, "acquire", 1, 9, "tts", waited_s=0.0),
    ev(9, "timeout", 0, 8, "embed", gpus=[0, 1], granted=[], waited_s=3.0),
    ev(10, "release", 1, 9, "tts", held_s=3.0),
    ev(25, "release", 0, 7, "train", gpus=2, gpu_set=[0, 1, 2, 3], granted=[0, 2], held_s=20.0),
]


def test_history_shows_a_multi_gpu_ticket_on_its_gpus() -> None:
    from gpulock.cli_history import _gpus_of, history_lines

    lines = history_lines(EVENTS)
    acquire = next(ln for ln in lines if " acquire " in ln and "train" in ln)
    assert " gpus 0,2 " in acquire and "granted" not in acquire
    wait = next(ln for ln in lines if " wait " in ln and "train" in ln)
    assert " gpus 0-3 " in wait
    timeout = next(ln for ln in lines if " timeout " in ln)
    assert " gpus 0,1 " in timeout
    assert " gpu1 " in next(ln for ln in lines if "tts" in ln)
    # --gpu 2: the multi-GPU holder's events are about gpu2 too; the pinned ones are not
    assert [e["ticket"] for e in EVENTS if 2 in _gpus_of(e)] == [7, 7, 7]


def test_the_report_draws_a_multi_gpu_hold_on_each_gpu_and_counts_it_once() -> None:
    data = build(EVENTS)
    holds = sorted((h.gpu, h.name, round(h.end_wall - h.start_wall)) for h in data.holds)
    assert holds == [(0, "train", 20), (1, "tts", 3), (2, "train", 20)]
    stats = {h.name: h for h in data.holders}
    assert (stats["train"].runs, stats["train"].held_s) == (1, 40.0)  # GPU-seconds
    assert (stats["embed"].runs, stats["embed"].timeouts) == (0, 1)
    waits = sorted((w.gpu, w.name, w.end) for w in data.waits)
    assert waits == [
        (0, "embed", "timeout"),
        (0, "train", "acquire"),
        (1, "embed", "timeout"),
        (1, "train", "acquire"),
        (2, "train", "acquire"),
        (3, "train", "acquire"),
    ]


def test_the_metrics_count_a_multi_gpu_grant_on_each_gpu() -> None:
    pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")
    from gpulock.metrics.tally import Tally, fold

    t = Tally()
    for e in EVENTS:
        fold(t, e)
    grants = t.counters["gpulock_grants"]
    assert grants == {("0", "train"): 1, ("2", "train"): 1, ("1", "tts"): 1}
    assert t.counters["gpulock_timeouts"] == {("0", "embed"): 1, ("1", "embed"): 1}
