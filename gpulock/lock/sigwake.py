"""Wake a ``poll()`` sleeper for a signal whose Python handler has not run yet.

CPython runs a signal's Python handler only between bytecodes of the main thread.  A signal
whose C-level handler runs just before the main thread enters ``poll()`` (or on another
thread) leaves the handler pending until ``poll`` returns for some other reason: for a waiter
in line, its next safety re-check, seconds later.  The C-level handler also writes the signal
number to the wake-up descriptor (``signal.set_wakeup_fd``); a sleeper that polls it too
returns at once, and the pending handler runs as soon as control is back in Python.

``SignalWake`` installs its own non-blocking pipe as the wake-up descriptor for the length of
a wait, and passes every byte it drains on to the descriptor that was there before (an event
loop's, ``gpulock run``'s), so whoever set that one still hears of every signal.
"""

from __future__ import annotations

import os
import signal
import threading


class SignalWake:
    """The wake-up pipe's read end while open (``fd``); ``None`` where signals cannot wake us.

    Only the main thread can set the wake-up descriptor, and only its sleep matters: Python
    handlers run nowhere else.
    """

    def __init__(self) -> None:
        self.fd: int | None = None
        self._w: int | None = None
        self._old = -1

    def open(self) -> int | None:
        if self.fd is not None or threading.current_thread() is not threading.main_thread():
            return self.fd
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter's main thread after all
            os.close(r)
            os.close(w)
            return None
        self.fd, self._w = r, w
        return r

    def drain(self) -> None:
        """Empty the pipe; the bytes (signal numbers) go on to the previous descriptor."""
        if self.fd is None:
            return
        try:
            while data := os.read(self.fd, 512):
                self._forward(data)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd is None or self._w is None:
            return
        signal.set_wakeup_fd(self._old)
        self.drain()  # a signal that came just before the swap back
        os.close(self.fd)
        os.close(self._w)
        self.fd = self._w = None

    def _forward(self, data: bytes) -> None:
        if self._old < 0:
            return
        try:
            os.write(self._old, data)
        except OSError:
            pass  # full or closed: as the C-level handler itself would, drop it
