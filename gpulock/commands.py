"""The subcommands that installed packages add (``gpulock serve``, ``gpulock governor``...):
their names and one-line summaries, for ``gpulock --help``, without importing them.

A package adds ``gpulock NAME`` with an entry point in the ``gpulock.commands`` group whose
target is a ``main(argv) -> int`` (see docs/code-layout.md).  Its summary is the first sentence
of that module's docstring, less a leading ``gpulock NAME``: label, read from the source file
(``ast``), so listing the commands imports none of them: ``gpulock serve``'s HTTP stack, the
scheduler of ``gpulock fleet`` and the like stay unloaded, and a package whose import fails
still shows up.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

GROUP = "gpulock.commands"

# "``gpulock agent`` (also ``python -m gpulock.agents``): run one agent" -> "run one agent"
_LABEL_RE = re.compile(r"^``gpulock [^`]*``[^:]*:\s+")
_SENTENCE_RE = re.compile(r"(?<=\.)\s")


def plugins() -> dict[str, EntryPoint]:
    """The installed packages' subcommands by name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def summaries(eps: dict[str, EntryPoint] | None = None) -> dict[str, str]:
    """``name -> one-line summary`` of every installed package's subcommand, sorted by name."""
    found = plugins() if eps is None else eps
    return {name: summary(found[name]) for name in sorted(found)}


def summary(ep: EntryPoint) -> str:
    """The first sentence of the entry point's module docstring, or where it comes from."""
    module = ep.value.partition(":")[0].strip()
    doc = _docstring(module)
    if doc:
        first = " ".join(doc.strip().split("\n\n")[0].split())
        first = _LABEL_RE.sub("", first)
        first = _SENTENCE_RE.split(first, maxsplit=1)[0].replace("``", "")
        if first:
            return first.rstrip(".")
    where = ep.dist.name if ep.dist is not None else module
    return f"(from {where})"


def _docstring(module: str) -> str | None:
    path = _source(module)
    if path is None:
        return None
    try:
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _source(module: str) -> Path | None:
    """The source file of ``module`` (``a.b.c``) without importing it or its packages.

    ``find_spec`` of a top-level name runs no code (a dotted one would import the parents);
    the rest of the path is looked up in the folders it names.
    """
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for folder in spec.submodule_search_locations or ():
        base = Path(folder).joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None
