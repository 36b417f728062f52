"""``gpulock status`` on a simulated GPU: what holders claim counts, exclusive or by need."""

from __future__ import annotations

from typing import Any

import pytest
from cli_helpers import Cli

GIB = 1024**3


def gpu0(cli: Cli) -> tuple[dict[str, Any], dict[str, Any]]:
    snap = cli.status()
    return snap["gpus"][0], snap["devices"][0]


def test_an_exclusive_holder_claims_the_whole_gpu(cli: Cli) -> None:
    holder = cli.hold("render")
    g, dev = gpu0(cli)
    assert g["total_bytes"] == 24 * GIB
    assert g["claimed_bytes"] == 24 * GIB and g["free_bytes"] == 0, g
    assert dev["reserved_bytes"] is None  # simulated: no driver reserves anything
    r = cli.run("status")
    head = r.stdout.splitlines()[0]
    assert "claimed 24.0 GiB (exclusive)" in head and ", free 0 B" in head, r.stdout
    assert "free 24.0 GiB" not in r.stdout, r.stdout
    holder.release()
    assert holder.wait() == 0
    g, _ = gpu0(cli)
    assert g["claimed_bytes"] == 0 and g["free_bytes"] == 24 * GIB, g


def test_holders_needs_count_as_claimed(cli: Cli) -> None:
    a = cli.hold("a", "--need", "6GiB")
    b = cli.hold("b", "--need", "2GiB")
    g, dev = gpu0(cli)
    assert g["claimed_bytes"] == 8 * GIB and g["free_bytes"] == 16 * GIB, g
    assert dev["used_bytes"] == 8 * GIB  # simulated use: the needs declared
    r = cli.run("status")
    assert "claimed 8.0 GiB by holders" in r.stdout and "free 16.0 GiB" in r.stdout, r.stdout
    for h in (a, b):
        h.release()
        assert h.wait() == 0


@pytest.mark.parametrize(("word", "said"), [("normal", False), ("freeze", True)])
def test_a_dead_governors_last_word_is_mentioned_only_when_it_matters(
    cli: Cli, word: str, said: bool
) -> None:
    import time

    from gpulock.core import level
    from gpulock.core.settings import load

    cli.state.mkdir(mode=0o700)
    settings = load(None, cli.state)
    now = time.time()
    level.write(settings, level.Published(word, now - 60, now - 50, 5.0, 999_999))
    r = cli.run("status")
    assert r.code == 0, r.describe()
    line = f"governor: not running (last word {word!r} ignored)"
    assert (line in r.stdout) == said, r.stdout
    if not said:
        assert "governor" not in r.stdout, r.stdout
