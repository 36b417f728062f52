"""The one validator every request body of ``gpulock serve`` passes before a handler reads it,
and the bounded parse in front of it.

The validator knows the small part of JSON Schema the request shapes use (``type``,
``properties``, ``required``, ``items``, ``anyOf``, ``enum``, ``minimum``, ``maximum``,
``minItems``, ``minLength``); a property may carry ``x-message``, the sentence a client reads
when that property is wrong.  Unknown properties are allowed: the official clients send more
than gpulock uses.  The shapes themselves are ``gpulock.serve.schema``'s.

Bodies are parsed with ``gpulock.core.safejson``: nesting past ``MAX_DEPTH`` (the deepest
legitimate request, a tool's JSON Schema, is a dozen levels) is refused before ``json.loads``
can recurse, as the state folder's readers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from gpulock.core import safejson

MAX_DEPTH: Final = 64

Schema = dict[str, Any]


class Invalid(ValueError):
    """A body that does not fit its endpoint: ``message`` for the client, ``param`` the
    top-level key at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None, *, explained: bool = False):
        super().__init__(message)
        self.message = message
        self.param = param
        self.explained = explained  # the message is a schema's own x-message


def loads(data: bytes) -> Any:
    """A request body as JSON: depth bounded first, then parsed; ``Invalid`` if it is not."""
    try:
        return safejson.loads(data, max_depth=MAX_DEPTH)
    except safejson.TooDeep:
        raise Invalid(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise Invalid("the request body is not valid UTF-8") from None
    except (ValueError, RecursionError):
        raise Invalid("the request body is not valid JSON") from None


def validate(obj: Any, schema: Schema) -> None:
    """Raise ``Invalid`` naming the first part of ``obj`` that does not fit ``schema``.

    A body that fits is accepted by the schema compiled once into closures (``_compiled``:
    no exceptions, no paths built, every lookup done at compile time): it was a tenth of the
    gateway's CPU.  One that does not is walked again by ``_check``, which says where."""
    if not isinstance(obj, dict):
        raise Invalid("the request body must be a JSON object")
    fast = _COMPILED.get(id(schema))
    if fast is None or fast[0] is not schema:
        fast = _COMPILED[id(schema)] = (schema, _compile(schema)[0])
    if not fast[1](obj):
        _check(obj, schema, "", None)


_TYPES: Final = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _check(v: Any, s: Schema, path: str, param: str | None) -> None:
    if isinstance(v, dict) and s.get("type") == "object":
        for k in s.get("required", ()):
            if k not in v:
                sub = s.get("properties", {}).get(k, {})
                said = sub.get("x-message")
                raise Invalid(said or f"'{k}' is required", param or k, explained=bool(said))
    if not _fits(v, s):
        typed = [a for a in s.get("anyOf", ()) if "type" in a and _TYPES[a["type"]](v)]
        if len(typed) == 1:  # the one alternative of this type may say more precisely
            try:
                _check(v, typed[0], path, param)
            except Invalid as inner:
                if inner.explained:
                    raise
        if "x-message" in s:
            raise Invalid(s["x-message"], param, explained=True)
        raise Invalid(f"'{path or 'body'}' does not fit: {_say(s)}", param)
    for k, sub in s.get("properties", {}).items():
        if isinstance(v, dict) and k in v:
            _check(v[k], sub, f"{path}.{k}" if path else k, param or k)
    items = s.get("items")
    if items is not None and isinstance(v, list):
        for i, x in enumerate(v):
            _check(x, items, f"{path}[{i}]", param)
    for alt in s.get("anyOf", ()):
        if _fits(v, alt):
            _check(v, alt, path, param)
            break


def _fits(v: Any, s: Schema) -> bool:
    """``v`` fits ``s`` at this level (and its ``anyOf``, deeply); properties are checked by
    ``_check`` so that the message names the deepest part at fault."""
    t = s.get("type")
    if t is not None and not _TYPES[t](v):
        return False
    if "enum" in s and v not in s["enum"]:
        return False
    if isinstance(v, int | float) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"]:
            return False
        if "maximum" in s and v > s["maximum"]:
            return False
    if isinstance(v, list | str):
        least: int = s.get("minItems", 0) if isinstance(v, list) else s.get("minLength", 0)
        if len(v) < least:
            return False
        if "maxItems" in s and len(v) > s["maxItems"]:
            return False
    if "anyOf" in s:
        return any(_deep_fits(v, alt) for alt in s["anyOf"])
    return True


def _deep_fits(v: Any, s: Schema) -> bool:
    try:
        _check(v, s, "", None)
    except Invalid:
        return False
    return True


def _say(s: Schema) -> str:
    if "anyOf" in s:
        return " or ".join(_say(a) for a in s["anyOf"])
    return str(s.get("type", "a value"))


# --- the same rules, compiled: a yes/no answer that ``_check`` would give by not raising ---------

Test = Callable[[Any], bool]
_COMPILED: dict[int, tuple[Schema, Test]] = {}


def _compile(s: Schema) -> tuple[Test, Test]:
    """(ok, fits) for ``s``: ``ok(v)`` is ``_check(v, s)`` not raising; ``fits(v)`` is
    ``_fits(v, s)``.  Rule for rule the same walk, so they cannot disagree."""
    t = s.get("type")
    type_ok = _TYPES[t] if t is not None else None
    if type_ok is not None and all(k == "type" or k[:2] == "x-" for k in s):
        return type_ok, type_ok  # a bare type (most leaves): its test is the whole rule
    required = tuple(s.get("required", ())) if t == "object" else ()
    enum: Any = s.get("enum")
    has_enum = "enum" in s
    lo: Any = s.get("minimum")
    hi: Any = s.get("maximum")
    has_lo, has_hi = "minimum" in s, "maximum" in s
    min_items: int = s.get("minItems", 0)
    min_len: int = s.get("minLength", 0)
    max_items: Any = s.get("maxItems")
    has_max_items = "maxItems" in s
    alts = [_compile(a) for a in s.get("anyOf", ())]
    has_alts = "anyOf" in s
    props = [(k, _compile(sub)[0]) for k, sub in s.get("properties", {}).items()]
    items = _compile(s["items"])[0] if s.get("items") is not None else None

    def fits(v: Any) -> bool:
        if type_ok is not None and not type_ok(v):
            return False
        if has_enum and v not in enum:
            return False
        if isinstance(v, int | float) and not isinstance(v, bool):
            if has_lo and v < lo:
                return False
            if has_hi and v > hi:
                return False
        if isinstance(v, list | str):
            least = min_items if isinstance(v, list) else min_len
            if len(v) < least or (has_max_items and len(v) > max_items):
                return False
        if has_alts:
            return any(ok_alt(v) for ok_alt, _ in alts)
        return True

    def ok(v: Any) -> bool:
        if required and isinstance(v, dict):
            for k in required:
                if k not in v:
                    return False
        if not fits(v):
            return False
        if props and isinstance(v, dict):
            for k, ok_sub in props:
                if k in v and not ok_sub(v[k]):
                    return False
        if items is not None and isinstance(v, list):
            for x in v:
                if not items(x):
                    return False
        for ok_alt, fits_alt in alts:
            if fits_alt(v):
                return ok_alt(v)
        return True

    return ok, fits
