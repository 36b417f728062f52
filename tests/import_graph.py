"""The import graph of the repository's packages, read from their source (no import runs).

Every ``import`` and ``from ... import`` counts, lazy ones inside functions and type-only ones
under ``TYPE_CHECKING`` included: a lazy arrow is still an arrow a reader must follow.
``python tests/import_graph.py`` prints the figures the layout is judged by.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# gpulock's floors, lowest first: a module may import its own room and the rooms below it.  The
# lock's side (core .. views) is what every cron job may load; the upper rooms are built on it.
ROOMS = ("core", "lock", "tenants", "residents", "face", "views")
VIEWS = ("report", "metrics")
# The rooms built on the lock's side, and the upper rooms each may import besides it:
# agents, serve -> router -> cluster -> the face <- governor.
UPPER: dict[str, tuple[str, ...]] = {
    "governor": (),
    "cluster": (),
    "router": ("cluster",),
    "serve": ("router", "cluster"),
    "agents": ("router",),
}


def modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file, for every module of gpulock (package data under share/ is not code)."""
    out = {}
    for path in sorted((root / "gpulock").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[1] == "share":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def _targets(module: str, path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                yield f"{base}.{a.name}"  # a submodule if there is one, else resolved to base


def edges(root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the gpulock modules it imports."""
    known = modules(root)
    out: dict[str, set[str]] = defaultdict(set)
    for mod, path in known.items():
        out[mod]
        for t in _targets(mod, path):
            hit = _resolve(t, known)
            if hit is not None and hit != mod:
                out[mod].add(hit)
    return dict(out)


def upper(module: str) -> str | None:
    """The upper room of a module (``gpulock.router.model`` -> ``router``), None below them."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in UPPER else None


def room(module: str) -> str | None:
    """The room of a module of the lock's side (None for an upper room's module)."""
    parts = module.split(".")
    if parts[0] != "gpulock" or upper(module):
        return None
    if len(parts) > 1 and parts[1] in ("core", "lock", "tenants", "residents"):
        return parts[1]
    if len(parts) > 1 and parts[1] in VIEWS:
        return "views"
    return "face"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@dataclass(frozen=True)
class Figures:
    modules: int
    arrows: int
    arrows_up: list[tuple[str, str]]
    circles: list[list[str]]
    depth: int  # the longest chain of imports between gpulock modules


def gpulock_graph(root: Path = REPO) -> dict[str, set[str]]:
    g = edges(root)
    return {m: {t for t in ts if t.startswith("gpulock")} for m, ts in g.items()}


def wrong_way(m: str, t: str) -> bool:
    """An arrow against the floors: up the lock's side, from the lock's side into an upper room,
    or between upper rooms other than agents, serve -> router -> cluster."""
    um, ut = upper(m), upper(t)
    if ut is not None:
        return um is None or (ut != um and ut not in UPPER[um])
    if um is not None:
        return False  # an upper room may reach the lock's side (through its doors: test_layout)
    rank = {name: i for i, name in enumerate(ROOMS)}
    return rank[room(t) or ""] > rank[room(m) or ""]


def figures(root: Path = REPO) -> Figures:
    g = gpulock_graph(root)
    up = sorted((m, t) for m, ts in g.items() for t in ts if wrong_way(m, t))
    found = circles(g)
    depth = 0
    if not found:
        memo: dict[str, int] = {}

        def chain(v: str) -> int:
            if v not in memo:
                memo[v] = 1 + max((chain(w) for w in g[v]), default=0)
            return memo[v]

        depth = max(chain(v) for v in g)
    return Figures(len(g), sum(len(ts) for ts in g.values()), up, found, depth)


def outside_imports(root: Path = REPO) -> dict[str, set[str]]:
    """Each upper room -> the modules of the lock's side it imports (its doors)."""
    out: dict[str, set[str]] = {p: set() for p in UPPER}
    for m, ts in edges(root).items():
        pkg = upper(m)
        if pkg is not None:
            out[pkg] |= {t for t in ts if upper(t) is None}
    return out


if __name__ == "__main__":
    f = figures()
    print(
        f"gpulock: {f.modules} modules, {f.arrows} arrows, {len(f.arrows_up)} arrows up, "
        f"{len(f.circles)} circles, import depth {f.depth}"
    )
    for a, b in f.arrows_up:
        print(f"  up: {a} -> {b}")
    for c in f.circles:
        print(f"  circle: {' '.join(c)}")
    for pkg, mods in outside_imports().items():
        print(f"{pkg}: {len(mods)} gpulock modules: {' '.join(sorted(mods))}")
