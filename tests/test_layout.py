"""The shape of the code: gpulock's rooms import only downward, and the rooms built on the lock's
side (router, serve, cluster, governor, agents) meet it at a few named doors.  Read from the source
(tests/import_graph.py), lazy and type-only imports counted; a failure names the arrow to remove."""

from __future__ import annotations

import json

import pytest
from import_graph import (
    REPO,
    UPPER,
    circles,
    edges,
    figures,
    gpulock_graph,
    outside_imports,
    room,
    upper,
    wrong_way,
)

# The doors of the lock's side for the rooms built on it, and which room may use which.  The
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


def test_no_import_circle_anywhere() -> None:
    assert circles(gpulock_graph()) == []


def test_the_circle_check_finds_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_arrow_runs_up_from_a_lower_room() -> None:
    assert figures().arrows_up == []


def test_the_lock_side_imports_none_of_the_rooms_built_on_it() -> None:
    wrong = sorted(
        (m, t) for m, ts in edges().items() if upper(m) is None
        for t in ts if upper(t) is not None
    )  # fmt: skip
    assert wrong == []


def test_the_upper_rooms_import_only_down_their_line() -> None:
    # agents, serve -> router -> cluster; the governor and the cluster know no other upper room
    assert wrong_way("gpulock.serve.dispatch", "gpulock.router.choose") is False
    assert wrong_way("gpulock.router.peers", "gpulock.cluster.place") is False
    assert wrong_way("gpulock.cluster.place", "gpulock.router.choose") is True
    assert wrong_way("gpulock.router.model", "gpulock.agents.spec") is True
    assert wrong_way("gpulock.governor.policy", "gpulock.serve.app") is True
    assert wrong_way("gpulock.status", "gpulock.router.probe") is True
    assert [a for a in figures().arrows_up if upper(a[0])] == []


def test_nothing_lives_at_the_top_level_but_gpulock() -> None:
    # One import name (issue 33): a top-level `agents`, `router`... would clash with other
    # distributions in the user's venv (the OpenAI Agents SDK installs `agents`).
    tops = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    assert tops == {"gpulock"}


def test_the_lock_knows_nothing_of_residents_tenants_or_eviction() -> None:
    g = gpulock_graph()
    wrong = sorted(
        (m, t) for m, ts in g.items() if room(m) in ("core", "lock")
        for t in ts if room(t) in ("tenants", "residents")
    )  # fmt: skip
    assert wrong == []


@pytest.mark.parametrize("package", sorted(UPPER))
def test_each_upper_room_meets_the_lock_side_at_its_doors(package: str) -> None:
    doors = COMMON + DOORS[package]
    assert len(doors) <= 8, f"{package} has {len(doors)} doors: {doors}"
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
