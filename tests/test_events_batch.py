"""``gpulock.core.events.Batch``: a busy server's events gathered and appended in one write."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gpulock.core import events


def lines(state: Path) -> list[str]:
    return [e["event"] for e in events.read(state)]


def test_a_batch_gathers_events_and_writes_them_in_one_write(tmp_path: Path) -> None:
    added: list[int] = []
    (tmp_path / "elsewhere").mkdir()
    b = events.batch(events.Batch(tmp_path, on_add=lambda b: added.append(len(b))))
    try:
        for i in range(5):
            events.emit(tmp_path, f"e{i}")
        events.emit(tmp_path / "elsewhere", "other")  # another folder: written at once
        assert lines(tmp_path) == [] and len(b) == 5
        assert added == [1]  # the owner is told once, when the batch stops being empty
        size = os.stat(tmp_path / "elsewhere" / events.LOG_NAME).st_size
        assert size > 0
        b.flush()
        assert lines(tmp_path) == [f"e{i}" for i in range(5)]
    finally:
        events.unbatch(b)
    events.emit(tmp_path, "after")  # unbatched: at once again
    assert lines(tmp_path)[-1] == "after"


def test_serves_write_behind_writes_when_the_last_request_ends(tmp_path: Path) -> None:
    from gpulock.core.settings import load
    from gpulock.serve.writebehind import WriteBehind

    s = load(None, str(tmp_path / "state"))

    async def run() -> tuple[list[str], list[str], list[str], list[str]]:
        wb = WriteBehind(s, every_s=3600)
        wb.start()
        try:
            wb.begin()
            s.emit("alone")  # one request in flight: written at once
            alone = lines(s.state_dir)
            wb.begin()
            s.emit("first")  # two: gathered
            wb.end()  # another request still in flight: it waits
            waiting = lines(s.state_dir)
            s.emit("second")
            wb.end()  # the last one: both written now, before its answer goes out
            written = lines(s.state_dir)
            wb.begin()
            wb.begin()
            await asyncio.to_thread(s.emit, "from a thread")  # within every_s, or at close
        finally:
            wb.close()
        return alone, waiting, written, lines(s.state_dir)

    alone, waiting, written, closed = asyncio.run(run())
    assert alone == ["alone"] and waiting == ["alone"]
    assert written == ["alone", "first", "second"]
    assert closed == ["alone", "first", "second", "from a thread"]
