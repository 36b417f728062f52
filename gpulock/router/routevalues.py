"""Checking one value of the route table: a mapping, a known key, text, a whole number, a size,
a duration, money, a price, a tiktoken encoding, a bytes-per-token ratio, ``tools:``, a tenant.

Each takes the config (for its ``error``: file, line and key), the key as the user would write it
(``routes.summarize[0].n_ctx``) and the value, and returns it parsed or raises ``ConfigError``
with a hint.  What each key means is ``gpulock.router.routes``'s, which reads the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpulock.core.apikeys import is_env_name
from gpulock.core.config import Config
from gpulock.core.errors import known_hint
from gpulock.core.units import parse_duration, parse_size, parse_usd

# llama-cpp-python's chat handlers that parse tool calls out of a model's text (a llama_cpp
# candidate's ``tools:``; see gpulock.router.tools).
TOOL_HANDLERS = ("chatml-function-calling", "functionary", "functionary-v1", "functionary-v2")


def mapping(cfg: Config, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise cfg.error(key, f"expected a mapping, got {type(value).__name__}: {value!r}")
    return value


def known_key(cfg: Config, where: str, key: Any, known: tuple[str, ...]) -> None:
    if key in known:
        return
    raise cfg.error(f"{where}.{key}", f"unknown key {key!r}", hint=known_hint(key, known))


def text(cfg: Config, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise cfg.error(key, f"expected text, got {value!r}")
    return value.strip()


def whole(cfg: Config, key: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise cfg.error(key, f"expected a whole number >= {low}, got {value!r}")
    return value


def opt_whole(cfg: Config, key: str, value: Any, *, low: int = 1) -> int | None:
    return None if value is None else whole(cfg, key, value, low=low)


def size(cfg: Config, key: str, value: Any) -> int:
    try:
        size = parse_size(value)
    except ValueError as e:
        raise cfg.error(key, str(e)) from None
    if size <= 0:
        raise cfg.error(key, f"expected a size above 0, got {value!r}")
    return size


def opt_size(cfg: Config, key: str, value: Any) -> int | None:
    return None if value is None else size(cfg, key, value)


def duration(cfg: Config, key: str, value: Any) -> float:
    try:
        seconds = parse_duration(value)
    except (ValueError, TypeError) as e:
        raise cfg.error(key, str(e)) from None
    if seconds <= 0:
        raise cfg.error(key, f"expected a duration above 0, got {value!r}")
    return seconds


def money(cfg: Config, key: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        return parse_usd(value)
    except ValueError as e:
        raise cfg.error(key, str(e)) from None


def price(cfg: Config, key: str, value: Any) -> tuple[float, float]:
    """``price: 0.0006`` (both directions) or ``{input: 0.00015, output: 0.0006}`` per 1k."""
    if value is None:
        return 0.0, 0.0
    if isinstance(value, Mapping):
        for k in value:
            known_key(cfg, key, k, ("input", "output"))
        return (
            money(cfg, f"{key}.input", value.get("input", 0)) or 0.0,
            money(cfg, f"{key}.output", value.get("output", 0)) or 0.0,
        )
    each = money(cfg, key, value) or 0.0
    return each, each


def tokenizer(cfg: Config, key: str, value: Any) -> str | None:
    from gpulock.router.tokens import ENCODINGS

    if value is None:
        return None
    if not isinstance(value, str) or value not in ENCODINGS:
        raise cfg.error(
            key,
            f"expected a tiktoken encoding, got {value!r}",
            hint=known_hint(str(value), ENCODINGS, "encodings"),
        )
    return value


def ratio(cfg: Config, key: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 64:
        raise cfg.error(
            key,
            f"expected the UTF-8 bytes a token covers at least (1 to 64, like 3.5), got {value!r}",
            hint="English is about 4 bytes a token, code 3, CJK text 1.5 to 3, emoji 1 to 2",
        )
    return float(value)


def tools(cfg: Config, key: str, value: Any, backend: str) -> bool | str | None:
    """``tools:``: true or false; for a llama_cpp candidate, the name of a chat handler."""
    if value is None or isinstance(value, bool):
        return value
    if backend == "llama_cpp" and isinstance(value, str) and value in TOOL_HANDLERS:
        return value
    if backend == "llama_cpp":
        raise cfg.error(
            key,
            f"expected false or a llama-cpp-python function-calling handler, got {value!r}",
            hint=known_hint(str(value), TOOL_HANDLERS, "handlers"),
        )
    raise cfg.error(key, f"expected true or false, got {value!r}")


def tenant(cfg: Config, key: str, value: Any, backend: str) -> Any:
    """The configured tenant a ``backend: tenant`` candidate names (its TenantSpec)."""
    if backend != "tenant":
        if value is not None:
            raise cfg.error(key, f"'tenant' is for backend: tenant, not {backend}")
        return None
    known = {t.name: t for t in cfg.tenants}
    if not isinstance(value, str) or value not in known:
        hint = (
            known_hint(value, known, "tenants")
            if known
            else "tenants: none is configured (add a tenants: list)"
        )
        raise cfg.error(key, f"expected the name of a tenant, got {value!r}", hint=hint)
    return known[value]


def env_name(text: str) -> bool:
    """A plausible variable name, not a pasted key (``sk-...``, ``sk_live_...``)."""
    return not text.lower().startswith(("sk-", "sk_")) and is_env_name(text)


def masked(text: str) -> str:
    """Enough to recognise the mistake (``sk-``... and a length), nothing of the secret."""
    prefix = text[:3] if text.lower().startswith(("sk-", "sk_")) else ""
    return f"{prefix}... {len(text)} characters"
