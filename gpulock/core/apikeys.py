"""API keys for gpulock's network listeners (``serve.api_keys_env``, ``metrics.api_keys_env``).

The config names an environment variable; the variable holds one or more keys, comma- or
whitespace-separated.  Keys never go in the config file, and nothing here puts one in a
message: errors name the variable, never its value.  A listener binds loopback unless keys
are configured (the house rule); ``is_loopback`` says which hosts count.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping


def is_env_name(text: str) -> bool:
    """Could ``text`` be an environment variable's name (and not a pasted key)?"""
    return (
        bool(text) and text.isascii() and text.replace("_", "").isalnum() and not text[0].isdigit()
    )


def split_keys(text: str) -> tuple[str, ...]:
    """``"k1, k2 k3"`` -> ``("k1", "k2", "k3")``."""
    return tuple(k for k in text.replace(",", " ").split() if k)


def read_keys(env_name: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys in the variable ``env_name``; () when it is None, unset or empty."""
    if env_name is None:
        return ()
    return split_keys((os.environ if environ is None else environ).get(env_name, ""))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bearer_ok(authorization: str | None, keys: Iterable[str]) -> bool:
    """Does an ``Authorization`` header carry one of ``keys`` as a bearer token?

    Compared in constant time against every key, so the answer's timing says nothing about
    which key came close.
    """
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    given = token.strip().encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok
