"""JSON from the state folder, read with its nesting bounded before it is parsed.

Anyone who may write the state folder (a group member, a crashed writer, a fuzzer) can put
``[[[[...`` there.  ``json.loads`` recurses once per level and dies with ``RecursionError`` a
few hundred levels down, wherever the caller's stack already stands; every record gpulock
writes is a handful of levels deep.  So the depth is counted first, by a scan that does not
recurse, and anything deeper than ``MAX_DEPTH`` is refused with a ``ValueError`` like any other
malformed record.  Size is the reader's business (``statefile.read_small`` bounds it).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

__all__ = ["MAX_DEPTH", "TooDeep", "check_depth", "loads"]

MAX_DEPTH: Final = 32  # tickets, records and events are 1-3 levels deep; the ledger 4
_TOKENS = re.compile(rb'["\\\[\]{}]')


class TooDeep(ValueError):
    """Nested past ``MAX_DEPTH``: refused as garbage rather than parsed."""


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that raises ``ValueError`` (never ``RecursionError``) for deep nesting.

    ``NaN``, ``Infinity`` and numbers too large for a float (``1e999``) are refused too: no
    record gpulock writes holds one, and each would poison every sum or comparison it enters.
    """
    check_depth(data, max_depth)
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number gpulock writes")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def check_depth(data: bytes | str, max_depth: int = MAX_DEPTH) -> None:
    """Raise TooDeep when arrays and objects nest deeper than ``max_depth`` in ``data``."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return  # cannot nest deeper than it has brackets: the common case costs two counts
    depth = 0
    in_string = False
    escaped_at = -1  # the position a backslash inside a string escapes
    for m in _TOKENS.finditer(raw):
        token, at = m.group(), m.start()
        if in_string:
            if at == escaped_at:
                continue
            if token == b"\\":
                escaped_at = at + 1
            elif token == b'"':
                in_string = False
        elif token == b'"':
            in_string = True
        elif token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise TooDeep(f"nested deeper than {max_depth} levels")
        elif token in (b"]", b"}"):
            depth -= 1
