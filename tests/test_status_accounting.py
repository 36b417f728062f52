"""``gpulock status`` on a simulated GPU: what holders claim counts, exclusive or by need."""

from __future__ import annotations

from typing import Any

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
