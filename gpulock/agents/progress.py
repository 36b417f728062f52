"""A one-line progress bar on stderr for a batch, only where a person is watching.

Shown only when stderr is a terminal, ``TERM`` is not ``dumb`` and ``GPULOCK_NO_PROGRESS`` is
unset: under cron (no terminal) it writes nothing at all, since cron mails any output.  The
line is redrawn in place with ``\\r`` at most ``REDRAW_S`` apart, and ended with a newline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Final, TextIO

from gpulock.core.units import format_duration

__all__ = ["ENV_NO_PROGRESS", "ProgressBar", "render", "wanted"]

ENV_NO_PROGRESS: Final = "GPULOCK_NO_PROGRESS"
REDRAW_S: Final = 0.1  # ten redraws a second look smooth and cost nothing
BAR_WIDTH: Final = 20


def wanted(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to draw on ``stream``: a terminal, TERM not dumb, GPULOCK_NO_PROGRESS unset."""
    env = os.environ if environ is None else environ
    if ENV_NO_PROGRESS in env or env.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def render(label: str, done: int, total: int, elapsed_s: float, done_here: int) -> str:
    """The bar's text (no ``\\r``): ``digest [#####.....] 300/600 50% 12.5/s eta 24.0 s``.

    ``done_here`` counts the items finished in this run: items resumed from a checkpoint
    took no time here, so they do not count towards the rate.
    """
    share = done / total if total > 0 else 1.0
    filled = min(BAR_WIDTH, int(share * BAR_WIDTH))
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    text = f"{label} [{bar}] {done}/{total} {share * 100:.0f}%"
    if done_here > 0 and elapsed_s > 0:
        rate = done_here / elapsed_s
        text += f" {rate:.1f}/s"
        if done < total:
            text += f" eta {format_duration((total - done) / rate)}"
    return text


class ProgressBar:
    """Draws ``render()`` on a stream; a no-op when ``enabled`` is False."""

    def __init__(
        self,
        stream: TextIO,
        label: str,
        total: int,
        done: int,
        *,
        enabled: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self.enabled = enabled
        self._clock = clock
        self._start = clock()
        self._first_done = done
        self._done = done
        self._drawn_at: float | None = None
        self._drawn_done = -1
        self._width = 0
        self._open = False

    def update(self, done: int) -> None:
        self._done = done
        if not self.enabled:
            return
        now = self._clock()
        if self._drawn_at is not None and now - self._drawn_at < REDRAW_S and done < self.total:
            return
        self._draw(now)

    def _draw(self, now: float) -> None:
        text = render(
            self.label, self._done, self.total, now - self._start, self._done - self._first_done
        )
        pad = " " * max(0, self._width - len(text))  # wipe the tail of a longer last line
        self._width = len(text)
        try:
            self.stream.write("\r" + text + pad)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False  # the terminal went away: the batch goes on without a bar
            return
        self._drawn_at = now
        self._drawn_done = self._done
        self._open = True

    def start(self) -> None:
        if self.enabled:
            self._draw(self._clock())

    def close(self) -> None:
        """End the line (once), so what is printed next starts on a line of its own."""
        if not self._open:
            return
        if self.enabled and self._drawn_done != self._done:
            self._draw(self._clock())  # the last update may have been skipped as too soon
        self._open = False
        try:
            self.stream.write("\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass
