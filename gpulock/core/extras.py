"""The pip command that adds an extra (``serve``, ``nvml``...) to *this* gpulock.

``pip install 'gpulock[serve]'`` is right for a copy from the package index, and wrong for a
checkout (it fetches another gpulock, or fails when none is published) and for a venv called
by its absolute path (cron, systemd), where the ``pip`` on ``PATH`` belongs to another Python.
``install_hint(extra)`` looks at where gpulock was installed from:

* running from a source checkout (``pyproject.toml`` naming gpulock beside the package) or an
  editable install: ``pip install -e '.[serve]'`` (the checkout's path when elsewhere);
* installed from a local folder, an archive or a VCS URL (pip's ``direct_url.json``, PEP 610):
  ``pip install '/src/gpulock[serve]'``, ``pip install 'gpulock[serve] @ git+https://...'``;
* otherwise the index: ``pip install 'gpulock[serve]'``.

The pip is ``python -m pip`` of the running interpreter unless the ``pip`` on ``PATH`` is its
own.  Only error paths call this, so its cost (reading the distribution's metadata) is paid
when a hint is printed, never by a cron job that takes the lock.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # above gpulock/
_NAME_RE = re.compile(r'^name\s*=\s*["\']gpulock["\']\s*$', re.MULTILINE)


def install_hint(extra: str, *, root: Path = PACKAGE_ROOT, cwd: Path | None = None) -> str:
    """``pip install ...`` that adds ``extra`` where this gpulock came from."""
    checkout = root if _is_checkout(root) else None
    origin = None if checkout is not None else _direct_url()
    return f"{_pip()} install {requirement(extra, checkout=checkout, origin=origin, cwd=cwd)}"


def requirement(
    extra: str,
    *,
    checkout: Path | None = None,
    origin: dict[str, object] | None = None,
    cwd: Path | None = None,
) -> str:
    """pip's argument for ``extra`` (quoted for a shell): from ``checkout``, the source folder
    gpulock runs from; else from ``origin``, pip's ``direct_url.json``; else the index."""
    if checkout is not None:
        return "-e " + shlex.quote(f"{_here(checkout, cwd)}[{extra}]")
    if origin is not None:
        url = str(origin.get("url", ""))
        info = origin.get("dir_info")
        parts = urlsplit(url)
        if parts.scheme == "file" and isinstance(info, dict):
            path = Path(unquote(parts.path))
            editable = "-e " if info.get("editable") else ""
            return editable + shlex.quote(f"{_here(path, cwd)}[{extra}]")
        vcs = origin.get("vcs_info")
        if isinstance(vcs, dict) and isinstance(vcs.get("vcs"), str):
            ref = f"@{vcs['requested_revision']}" if vcs.get("requested_revision") else ""
            return shlex.quote(f"gpulock[{extra}] @ {vcs['vcs']}+{url}{ref}")
        if url:  # an archive (a wheel or sdist by path or URL)
            return shlex.quote(f"gpulock[{extra}] @ {url}")
    return shlex.quote(f"gpulock[{extra}]")


def _is_checkout(root: Path) -> bool:
    """``root`` holds a pyproject.toml that builds gpulock (not a site-packages folder)."""
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return bool(_NAME_RE.search(text))


def _direct_url() -> dict[str, object] | None:
    """pip's record of where the installed gpulock came from (PEP 610), if any."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        text = distribution("gpulock").read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _here(path: Path, cwd: Path | None) -> str:
    """``.`` when ``path`` is the working folder, else the path itself."""
    try:
        here = (cwd or Path.cwd()).resolve()
    except OSError:  # the working folder was removed
        return str(path)
    return "." if here == path.resolve() else str(path)


def _pip() -> str:
    """``pip`` when that is the running interpreter's own, else ``<python> -m pip``."""
    found = shutil.which("pip")
    if found is not None:
        own = Path(sys.executable).parent
        if Path(found).parent == own or Path(os.path.realpath(found)).parent == own:
            return "pip"
    return f"{shlex.quote(sys.executable)} -m pip"
