"""The shape of the code: gpulock's rooms import only downward, and the packages built on it
meet it at a few named doors.  Read from the source (tests/import_graph.py), lazy and type-only
imports counted; a failure names the arrow to remove."""

from __future__ import annotations

import json

import pytest
from import_graph import (
    PACKAGES,
    REPO,
    circles,
    edges,
    figures,
    gpulock_graph,
    outside_imports,
    room,
)

# The doors of gpulock for the packages built on it, and which package may use which.  The
# public face (``gpulock``), ``gpulock.core`` and the CLI toolkit (``gpulock.cli``: Parser,
# run_command, print_json... for subcommands) are open to all.
COMMON = ("gpulock", "gpulock.core.", "gpulock.cli")
DOORS = {
    "router": ("gpulock.residents.", "gpulock.tenants.", "gpulock.status"),
    "serve": ("gpulock.residents.", "gpulock.tenants.", "gpulock.status", "gpulock.metrics."),
    "governor": ("gpulock.arbiter", "gpulock.metrics."),
    # agents: gpulock.pool runs a pooled agent's workers (@agent(workers=...), issue 21)
    "agents": ("gpulock.report.", "gpulock.pool."),
    "cluster": (),  # the public face, core and the CLI toolkit are all it needs
}


def _through(module: str, doors: tuple[str, ...]) -> bool:
    """A door: one module (``gpulock.status``), or a package and all in it (``gpulock.core.``)."""
    return any(
        module.startswith(d) or module == d[:-1] if d.endswith(".") else module == d for d in doors
    )


def test_gpulock_has_no_import_circle() -> None:
    assert circles(gpulock_graph()) == []


def test_no_arrow_runs_up_from_a_lower_room() -> None:
    assert figures().arrows_up == []


def test_gpulock_imports_none_of_the_packages_built_on_it() -> None:
    wrong = sorted(
        (m, t) for m, ts in edges().items() if m.startswith("gpulock")
        for t in ts if not t.startswith("gpulock")
    )  # fmt: skip
    assert wrong == []


def test_the_lock_knows_nothing_of_residents_tenants_or_eviction() -> None:
    g = gpulock_graph()
    wrong = sorted(
        (m, t) for m, ts in g.items() if room(m) in ("core", "lock")
        for t in ts if room(t) in ("tenants", "residents")
    )  # fmt: skip
    assert wrong == []


@pytest.mark.parametrize("package", PACKAGES[1:])
def test_each_package_meets_gpulock_at_its_doors(package: str) -> None:
    doors = COMMON + DOORS[package]
    wrong = sorted(m for m in outside_imports()[package] if not _through(m, doors))
    assert wrong == [], f"{package} opens gpulock's inner modules: {wrong}; doors: {doors}"


def test_the_door_check_catches_an_inner_module() -> None:
    assert not _through("gpulock.lock.queuedir", COMMON + DOORS["router"])
    assert not _through("gpulock.corex", COMMON)
    assert _through("gpulock.core.state", COMMON)
    assert _through("gpulock.residents.eviction", COMMON + DOORS["router"])
    assert _through("gpulock.core", COMMON) and _through("gpulock", COMMON)
    assert not _through("gpulock.runner", COMMON)


def test_the_plugin_example_in_the_docs_runs(capsys: pytest.CaptureFixture[str]) -> None:
    page = (REPO / "docs" / "code-layout.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(code, "docs/code-layout.md", "exec"), scope)  # noqa: S102 (our own docs)
    main = scope["main"]
    assert callable(main)
    assert main(["ada"]) == 0
    assert capsys.readouterr().out == "hello ada\n"
    assert main(["--json", "ada"]) == 0
    assert json.loads(capsys.readouterr().out) == {"hello": "ada"}
    assert main(["1x"]) == 2  # a user's mistake: error: on stderr, exit 2, no traceback
    assert capsys.readouterr().err.startswith("error: not a name: '1x'")
