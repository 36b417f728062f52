"""llama.cpp's log, tapped: the last lines it wrote, kept so that a failure can say why.

With ``verbose=False`` llama-cpp-python raises only "Failed to load model from file" or "Failed
to create llama_context"; why (a cudaMalloc that ran out of memory, a damaged file) is in
llama.cpp's log.  The tap keeps a numbered window of it: a call takes ``log_mark()`` before it
runs and, when it fails, reads ``log_since(mark)``.  Installed once per process, on the first load
(``llama_cpp`` is passed in: this module imports nothing heavy).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any


def is_oom(text: str) -> bool:
    t = text.lower()
    return "out of memory" in t or "cudamalloc" in t or "failed to allocate" in t


# llama.cpp's last log lines, numbered.  With verbose=False llama-cpp-python raises only
# "Failed to load model from file" or "Failed to create llama_context"; why (a cudaMalloc that
# ran out of memory, a damaged file) is in llama.cpp's log, which the tap keeps a window of.
_log: deque[tuple[int, str]] = deque(maxlen=64)
_log_count = itertools.count(1)
_tap: Any = None


def install_log_tap(llama_cpp: Any) -> None:
    """Route llama.cpp's log through a tap that remembers it, then on to llama-cpp-python's
    own handler (which prints what its verbosity allows), so nothing else changes."""
    global _tap
    if _tap is not None:
        return
    import ctypes

    try:
        from llama_cpp import _logger

        forward = _logger.llama_log_callback
    except (ImportError, AttributeError):
        forward = None

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def tap(level: int, text: bytes, user_data: Any) -> None:
        _log.append((next(_log_count), text.decode("utf-8", "replace").strip()))
        if forward is not None:
            forward(level, text, user_data)

    _tap = tap  # ctypes calls it for ever: it must outlive this function
    llama_cpp.llama_log_set(tap, ctypes.c_void_p(0))


def log_mark() -> int:
    return _log[-1][0] if _log else 0


def log_since(mark: int) -> list[str]:
    return [line for n, line in list(_log) if n > mark and line]
