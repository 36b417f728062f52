"""Child Python processes that the current folder cannot shadow.

``python -m gpulock.agents`` puts the current folder first on ``sys.path``, so a folder named
``gpulock`` there (a checkout, a backup, one of the user's own) would be imported instead of the
installed package, and a fleet started from the wrong folder would fail every run.  ``-P``
(Python 3.11) leaves that folder out; every Python that gpulock starts is started with it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final

SAFE_PATH: Final = "-P"


def python(*args: str, executable: str | None = None) -> tuple[str, ...]:
    """``python -P ARGS...``: this interpreter (or ``executable``), the current folder left out."""
    return (executable or sys.executable, SAFE_PATH, *args)


def again(orig_argv: Sequence[str] | None = None) -> tuple[str, ...]:
    """This process's own command line (``sys.orig_argv``), to start another of it (a pool
    worker), with the current folder left out of the new one's ``sys.path``."""
    argv = sys.orig_argv if orig_argv is None else orig_argv
    rest = list(argv[1:])
    return python(*rest) if SAFE_PATH not in rest[:1] else (sys.executable, *rest)
