"""The pool's rules, as pure functions: when to ask for another worker, how long to back off
after a failure, when the failures in a row are too many, how an exit reads.

Everything here takes the world as arguments and returns data, so the rules are table-tested
without processes (``tests/test_pool.py``); ``gpulock.pool.supervisor`` acts on them.
"""

from __future__ import annotations

import signal

BACKOFF_FIRST_S = 0.5  # the wait before replacing the first failed worker of a row
BACKOFF_MAX_S = 30.0  # ...doubling per failure in a row, up to this
HEALTHY_S = 60.0  # a worker that ran this long before failing starts a new row


def may_ask(
    *,
    running: int,
    held: int,
    max_workers: int,
    asking: bool,
    finishing: bool,
    backoff_until: float,
    now: float,
) -> bool:
    """Whether the pool should put one more ticket in line now.

    Never a second waiting ticket (``asking``); never once a worker finished its share or the
    pool is stopping (``finishing``); never at ``max_workers``; never during a back-off.
    """
    if asking or finishing:
        return False
    if running + held >= max_workers:
        return False
    return now >= backoff_until


def next_streak(streak: int, ran_s: float) -> int:
    """Failures in a row after one more: a worker that ran ``HEALTHY_S`` first starts anew."""
    return 1 if ran_s >= HEALTHY_S else streak + 1


def backoff_s(streak: int) -> float:
    """The wait before the replacement of the ``streak``-th failure in a row."""
    if streak <= 0:
        return 0.0
    return float(min(BACKOFF_FIRST_S * 2 ** (streak - 1), BACKOFF_MAX_S))


def gives_up(streak: int, retries: int) -> bool:
    """``--retries N``: N failures in a row are replaced; the next one stops the pool."""
    return streak > retries


def exit_code(returncode: int) -> int:
    """A worker's exit as a shell reports it (``gpulock run`` likewise): 128+N for signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def exit_reason(returncode: int) -> str:
    """``done`` for 0, ``exit 3``, ``killed by SIGKILL`` (an OOM kill reads so too)."""
    if returncode == 0:
        return "done"
    if returncode > 0:
        return f"exit {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}"


def default_max(budget_bytes: int | None, need_bytes: int) -> int:
    """``--max`` left out: as many as could ever fit the GPU's budget (1 when unknown)."""
    if budget_bytes is None:
        return 1
    return max(budget_bytes // need_bytes, 1)
