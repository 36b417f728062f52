"""JSON over HTTP for the tenant adapters: stdlib only, short timeouts, one error type.

Every failure a server can produce (refused, timed out, a 500, garbage, a redirect to a file)
becomes a ``TenantUnreachable`` or ``TenantHttpError`` whose text says what happened, so a
listing can show it and no caller ever sees a raw ``urllib`` exception.  The API key (from the
variable ``api_key_env`` names) goes in the ``Authorization`` header and nowhere else.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from gpulock.core.errors import GpulockError

MAX_BODY = 8 << 20  # a model list is kilobytes; anything past this is not an answer


class TenantError(GpulockError):
    """A tenant could not be asked, or did not do what it was asked."""


class TenantUnreachable(TenantError):
    """No HTTP answer at all: refused, timed out, reset, not HTTP."""


class TenantBusy(TenantError):
    """The server is serving: unloading now would break a request (refused unless forced)."""


class TenantHttpError(TenantError):
    """An HTTP answer that is an error status, or a body that is not the JSON expected."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A tenant's API never redirects; following one could land on file:// or elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class Client:
    """One tenant's base URL, key and timeout."""

    def __init__(self, base_url: str, *, api_key_env: str | None = None, timeout_s: float = 0.8):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TenantUnreachable(f"not an http:// URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s

    def url(self, path: str) -> str:
        return path if "://" in path else f"{self.base_url}/{path.lstrip('/')}"

    def _prepare(
        self, method: str, path: str, body: Any
    ) -> tuple[urllib.request.Request, str, Callable[[str], str]]:
        url = self.url(path)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"

        def scrub(text: str) -> str:
            # A careless server or proxy may echo the request's headers in its error page:
            # the key must not ride along into listings, events and error messages.
            return text.replace(key, "[api key]") if key else text

        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise TenantUnreachable(f"not an http:// URL: {url!r}")
        req = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
        return req, f"{method} {urllib.parse.urlsplit(url).path or '/'}", scrub

    def _open(
        self, req: urllib.request.Request, where: str, wait: float, scrub: Callable[[str], str]
    ) -> Any:
        """The open response, or the failure as a TenantError (never a urllib exception)."""
        try:
            return _OPENER.open(req, timeout=wait)
        except urllib.error.HTTPError as e:
            text = scrub(_text(e))
            if 300 <= e.code < 400:
                raise TenantHttpError(
                    f"{where}: redirected ({e.code}); not followed", status=e.code
                ) from None
            raise TenantHttpError(
                f"{where}: HTTP {e.code} {_short(text)}", status=e.code, body=text
            ) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, socket.timeout | TimeoutError):
                raise TenantUnreachable(f"{where}: no answer in {wait:g} s") from None
            if isinstance(reason, OSError) and reason.strerror:
                raise TenantUnreachable(f"{where}: {reason.strerror}") from None
            raise TenantUnreachable(f"{where}: {reason}") from None
        except TimeoutError:
            raise TenantUnreachable(f"{where}: no answer in {wait:g} s") from None
        except (http.client.HTTPException, ConnectionError) as e:
            raise TenantUnreachable(f"{where}: not an HTTP answer ({type(e).__name__})") from None
        except OSError as e:
            raise TenantUnreachable(f"{where}: {e.strerror or e}") from None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        expect_json: bool = True,
    ) -> Any:
        """The decoded JSON answer (or the text when ``expect_json`` is false)."""
        req, where, scrub = self._prepare(method, path, body)
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            with self._open(req, where, wait, scrub) as resp:
                raw = resp.read(MAX_BODY + 1)
        except (TimeoutError, http.client.HTTPException, ConnectionError) as e:
            raise TenantUnreachable(f"{where}: answer cut off ({type(e).__name__})") from None
        if len(raw) > MAX_BODY:
            raise TenantHttpError(f"{where}: answer larger than {MAX_BODY >> 20} MiB")
        if not expect_json:
            return raw.decode("utf-8", "replace")
        try:
            return json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):
            raise TenantHttpError(
                f"{where}: answer is not JSON: {_short(scrub(raw.decode('utf-8', 'replace')))}"
            ) from None

    def lines(self, path: str, body: Any, *, timeout_s: float | None = None) -> Iterator[str]:
        """POST ``body`` and yield the answer's lines as they come (NDJSON, server-sent events)."""
        req, where, scrub = self._prepare("POST", path, body)
        wait = self.timeout_s if timeout_s is None else timeout_s
        with self._open(req, where, wait, scrub) as resp:
            try:
                for raw in resp:
                    yield raw.decode("utf-8", "replace").rstrip("\r\n")
            except (TimeoutError, http.client.HTTPException, ConnectionError) as e:
                raise TenantUnreachable(f"{where}: stream cut off ({type(e).__name__})") from None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, {} if body is None else body, **kw)


def _text(e: urllib.error.HTTPError) -> str:
    try:
        return e.read(4096).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return ""


def _short(text: str, width: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def obj(value: Any, where: str) -> dict[str, Any]:
    """``value`` when it is a JSON object, else a ``TenantHttpError`` saying so."""
    if not isinstance(value, dict):
        raise TenantHttpError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def items(value: Any, where: str) -> list[dict[str, Any]]:
    """The objects of a JSON list (non-objects are skipped: garbage is never a crash)."""
    if not isinstance(value, list):
        raise TenantHttpError(f"{where}: expected a JSON list, got {type(value).__name__}")
    return [v for v in value if isinstance(v, dict)]


def sub(value: dict[str, Any], key: str) -> dict[str, Any]:
    """``value[key]`` when it is a JSON object, else an empty one (garbage is no crash)."""
    got = value.get(key)
    return got if isinstance(got, dict) else {}
