"""gpulock.router.waitest: the queue-wait estimate, table-tested (pure: no file, clock or GPU)."""

from __future__ import annotations

import pytest

from gpulock.router.choose import GpuView, Host
from gpulock.router.waitest import (
    HoldHistory,
    Queued,
    estimate_wait,
    history_from,
    hold_left,
    quantile,
)

GiB = 1024**3
QUICK = [("tagger", 0.05)] * 20

# The issue's repro: a 6 s exclusive holder 1 s in and two 3 s waiters, with quick jobs filling
# the recent history.  The GPU-wide median (0.05 s) made this "~112 ms"; the truth is ~11 s.
REPRO_HISTORY = history_from([("render", 6.0), ("render", 6.2), ("tts", 3.0), *QUICK], 30.0)
REPRO_LINE = (Queued("render", None, 1.0), Queued("tts", None), Queued("tts", None))


def test_the_issues_repro_estimates_the_true_wait() -> None:
    assert estimate_wait(REPRO_LINE, REPRO_HISTORY) == pytest.approx(5.2 + 3.0 + 3.0)


H = history_from([("a", 10.0), ("a", 12.0), ("a", 30.0), ("b", 2.0), ("b", 4.0)], 30.0)


@pytest.mark.parametrize(
    ("line", "history", "need", "budget", "expected"),
    [
        ((), H, None, None, 0.0),  # nobody ahead
        # a holder 11 s in: only the 12 s and 30 s holds are still running at 11 s: p90 -> 19 s
        ((Queued("a", None, 11.0),), H, None, None, 19.0),
        # past every hold seen: about as long again
        ((Queued("a", None, 40.0),), H, None, None, 40.0),
        # an unknown name falls back to the GPU's holds (p90 of 10,12,30,2,4 = 30)
        ((Queued("zz", None),), H, None, None, 30.0),
        # no history at all: the configured hold estimate, minus what a holder held already
        ((Queued("x", None, 10.0),), HoldHistory(default_s=30.0), None, None, 20.0),
        ((Queued("x", None, 40.0),), HoldHistory(default_s=30.0), None, None, 40.0),
        # a waiter starts after the holder; the newcomer after the waiter
        ((Queued("b", None, 1.0), Queued("b", None)), H, None, None, 3.0 + 4.0),
        # shared needs: a newcomer with a need that fits next to the holders does not wait
        ((Queued("a", 4 * GiB, 1.0),), H, 4 * GiB, 20 * GiB, 0.0),
        # ...but an exclusive one waits for them, and so does one that does not fit
        ((Queued("a", 4 * GiB, 1.0),), H, None, 20 * GiB, 29.0),
        ((Queued("a", 4 * GiB, 1.0),), H, 18 * GiB, 20 * GiB, 29.0),
        # two sharers holding; the newcomer needs only the shorter one gone
        (
            (Queued("a", 8 * GiB, 1.0), Queued("b", 8 * GiB, 1.0)),
            H,
            8 * GiB,
            20 * GiB,
            3.0,
        ),
        # FIFO: a waiter with a need starts next to a sharer; the newcomer never before it
        ((Queued("a", 8 * GiB, 1.0), Queued("b", 8 * GiB)), H, 8 * GiB, 20 * GiB, 4.0),
        # an exclusive waiter ahead: the newcomer's need cannot share with it
        ((Queued("b", None, 1.0), Queued("b", None)), H, 1 * GiB, 20 * GiB, 7.0),
    ],
)
def test_estimate_wait(
    line: tuple[Queued, ...],
    history: HoldHistory,
    need: int | None,
    budget: int | None,
    expected: float,
) -> None:
    assert estimate_wait(line, history, need_bytes=need, budget_bytes=budget) == pytest.approx(
        expected
    )


def test_the_quantile_sets_how_pessimistic() -> None:
    line = (Queued("a", None),)
    assert estimate_wait(line, H, q=0.5) == pytest.approx(12.0)
    assert estimate_wait(line, H, q=0.9) == pytest.approx(30.0)
    assert quantile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert quantile([3.0, 1.0, 2.0], 1.0) == 3.0


def test_history_keeps_the_recent_holds_per_name() -> None:
    h = history_from([("a", float(i)) for i in range(30)] + [("b", 1.0)], 30.0, per_name=5)
    assert h.by_name["a"] == (25.0, 26.0, 27.0, 28.0, 29.0)
    assert h.of("b") == (1.0,)
    assert h.of("nobody") == h.gpu
    assert hold_left(Queued("b", None), h, 0.9) == 1.0


def test_choose_decides_the_deadline_against_the_line() -> None:
    from gpulock.router.choose import choose
    from gpulock.router.routes import Candidate

    gpu_c = Candidate(
        task="t",
        key="routes.t[0]",
        tier="gpu",
        backend="llama_cpp",
        model="/m.gguf",
        name="m",
        n_ctx=512,
        n_gpu_layers=-1,
        n_batch=512,
        n_threads=None,
        vram_bytes=4 * GiB,
        min_vram_bytes=None,
        price_in_per_1k=0.0,
        price_out_per_1k=0.0,
        daily_budget_usd=None,
        rate_limit_per_min=None,
        base_url=None,
        api_key_env=None,
        policy="persistent",
        timeout_s=60.0,
        gpu=None,
        max_tokens=64,
    )
    g = GpuView(0, 24 * GiB, 21 * GiB, 0, 3, 0.1, None, REPRO_LINE, REPRO_HISTORY)
    c = choose("t", (gpu_c,), Host(gpus=(g,)), deadline_s=5.0)
    assert c.chosen is None
    assert c.verdicts[0].reason == "gpu0 queue: ~11.2 s wait (3 ahead) > deadline 5.0 s"
    c = choose("t", (gpu_c,), Host(gpus=(g,)), deadline_s=20.0)
    assert c.chosen is not None and c.chosen.reason == "gpu0: needs 4.0 GiB, ~11.2 s queue wait"
