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
PACKAGES = ("gpulock", "router", "governor", "agents", "serve", "cluster")

# gpulock's rooms, lowest first: a module may import its own room and the rooms below it.
ROOMS = ("core", "lock", "tenants", "residents", "face", "views")
VIEWS = ("report", "metrics")


def modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file, for every module of the five packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
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
    """Module -> the modules of the five packages it imports."""
    known = modules(root)
    out: dict[str, set[str]] = defaultdict(set)
    for mod, path in known.items():
        out[mod]
        for t in _targets(mod, path):
            hit = _resolve(t, known)
            if hit is not None and hit != mod:
                out[mod].add(hit)
    return dict(out)


def room(module: str) -> str | None:
    """The room of a gpulock module (None outside gpulock)."""
    parts = module.split(".")
    if parts[0] != "gpulock":
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
    return {
        m: {t for t in ts if t.startswith("gpulock")}
        for m, ts in g.items()
        if m.startswith("gpulock")
    }


def figures(root: Path = REPO) -> Figures:
    g = gpulock_graph(root)
    rank = {name: i for i, name in enumerate(ROOMS)}
    up = sorted(
        (m, t) for m, ts in g.items() for t in ts if rank[room(t) or ""] > rank[room(m) or ""]
    )
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
    """Each package above gpulock -> the gpulock modules it imports."""
    out: dict[str, set[str]] = {p: set() for p in PACKAGES[1:]}
    for m, ts in edges(root).items():
        pkg = m.split(".")[0]
        if pkg in out:
            out[pkg] |= {t for t in ts if t.startswith("gpulock")}
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
