"""The wheel, as users install it: not editable, into a fresh venv outside the checkout, beside
the OpenAI Agents SDK (whose top-level ``agents`` package is a name gpulock once wrote into), and
run from a folder holding an ``agents/`` folder of the user's own.

``make wheelhouse`` (a step of ``make test``) builds the wheel and gathers the wheels it is
installed with; the venv is made here, offline, from that folder.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_helpers import REPO, STRIPPED

WHEELHOUSE = REPO / "build" / "wheelhouse"
RUN_S = 300  # a venv and pip on a loaded 2-core machine


def _wheel() -> Path:
    found = sorted(WHEELHOUSE.glob("gpulock-*.whl"))
    if not found:
        pytest.skip(f"no wheel in {WHEELHOUSE}: 'make wheelhouse' builds it (make test does)")
    wheel = found[-1]
    sources = [
        p for p in (REPO / "gpulock").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ]
    newest = max(p.stat().st_mtime for p in [*sources, REPO / "pyproject.toml"])
    if wheel.stat().st_mtime < newest:
        pytest.skip(f"{wheel.name} is older than the code: 'make wheelhouse' builds it again")
    return wheel


@dataclass
class Installed:
    venv: Path
    site: Path
    home: Path  # the user's folder: holds an agents/ folder of the user's own
    env: dict[str, str]

    def run(self, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=cwd or self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=RUN_S,
        )

    def gpulock(self, *args: str) -> subprocess.CompletedProcess[str]:
        r = self.run(str(self.venv / "bin" / "gpulock"), *args)
        assert r.returncode == 0, f"gpulock {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}"
        return r


def _pip(venv: Path, *args: str) -> None:
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
         "--disable-pip-version-check", "--find-links", str(WHEELHOUSE), *args],
        check=True, timeout=RUN_S, capture_output=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    wheel = _wheel()
    root = tmp_path_factory.mktemp("wheel")
    assert not root.resolve().is_relative_to(REPO.resolve())
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=RUN_S)
    # The SDK first, without its dependencies (its files are what must stay untouched), then
    # gpulock with its llama extra, as a user adds it to the venv their agents live in.
    _pip(venv, "--no-deps", "openai-agents")
    _pip(venv, f"{wheel}[llama]")
    site = next((venv / "lib").glob("python3*/site-packages"))
    home = root / "home"
    (home / "agents").mkdir(parents=True)  # the user's own agents/ folder, as docs once showed
    (home / "agents" / "__init__.py").write_text(
        "raise ImportError('the user folder, not a package')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED and k != "VIRTUAL_ENV"}
    env |= {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "GPULOCK_STATE_DIR": str(root / "state"),
        "GPULOCK_SIMULATE": "24GiB",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("PYTHONPATH", None)
    yield Installed(venv, site, home, env)


def _record(site: Path, dist: str) -> dict[str, str]:
    """path -> sha256 (as RECORD writes it) of every file a distribution installed."""
    [info] = site.glob(f"{dist}-*.dist-info")
    with open(info / "RECORD", newline="") as f:
        return {row[0]: row[1] for row in csv.reader(f) if row and row[1]}


def _sha(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_the_wheel_installs_only_gpulock_at_the_top(installed: Installed) -> None:
    tops = {p.split("/")[0] for p in _record(installed.site, "gpulock")}
    assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"gpulock"}, tops
    files = set(_record(installed.site, "gpulock"))
    for shipped in (
        "gpulock/share/crontab.example",
        "gpulock/share/grafana-dashboard.json",
        "gpulock/share/systemd/gpulock-governor.service",
        "gpulock/share/examples/tiny.yaml",
        "gpulock/agents/examples/digest.py",
    ):
        assert shipped in files, shipped
    assert not any(
        f.startswith(("tests/", "bench/", "docs/")) or f.endswith(".gguf") for f in files
    )


def test_the_sdks_agents_package_is_untouched(installed: Installed) -> None:
    sdk = _record(installed.site, "openai_agents")
    ours = _record(installed.site, "gpulock")
    on_disk = {
        str(p.relative_to(installed.site))
        for p in (installed.site / "agents").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert on_disk and on_disk <= set(sdk), sorted(on_disk - set(sdk))
    assert not [f for f in ours if f.startswith("agents/")]
    changed = [f for f in on_disk if _sha(installed.site / f) != sdk[f]]
    assert changed == []
    # `import agents` still finds the SDK's package (found, not run: its dependencies were
    # left out), from the user's folder too, which has an agents/ folder of its own: -P, as
    # every Python gpulock starts.
    code = "import importlib.util; print(importlib.util.find_spec('agents').origin)"
    r = installed.run(str(installed.venv / "bin" / "python"), "-P", "-c", code)
    assert r.stdout.strip() == str(installed.site / "agents" / "__init__.py"), r.stderr


def test_the_commands_work_from_a_folder_holding_agents(installed: Installed) -> None:
    assert "exit codes" in installed.gpulock("--help").stdout
    installed.gpulock("run", "--", "true")
    status = json.loads(installed.gpulock("status", "--json").stdout)
    assert status["gpus"][0]["total_bytes"] == 24 * 1024**3, status
    listed = json.loads(installed.gpulock("agent", "list", "--json").stdout)
    assert {"digest", "inbox-triage"} <= {a["name"] for a in listed["agents"]}, listed
    files = json.loads(installed.gpulock("files", "--json").stdout)["files"]
    assert files and all(f["exists"] for f in files), files
    assert all(Path(f["path"]).is_relative_to(installed.site / "gpulock") for f in files)
    grafana = installed.gpulock("files", "grafana").stdout.strip()
    assert json.loads(Path(grafana).read_text())["panels"]


def test_the_router_runs_the_tiny_model_from_the_wheel(installed: Installed) -> None:
    model = installed.home / "models" / "tiny.gguf"
    py = str(installed.venv / "bin" / "python")
    r = installed.run(py, "-m", "gpulock.router.tiny_model", str(model))
    assert r.returncode == 0, r.stderr
    config = installed.home / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            routes:
              summarize:
                - {{tier: cpu, backend: llama_cpp, model: {model}, name: tiny-cpu, max_tokens: 4}}
            """
        )
    )
    code = (
        "from gpulock import router\n"
        f"m = router.get_model('summarize', config={str(config)!r})\n"
        "print(m.name, type(m.complete('Summarise: a b c')).__name__)\n"
    )
    r = installed.run(py, "-c", code)  # no -P: the folder's own agents/ is first on sys.path
    assert (r.returncode, r.stdout.split()) == (0, ["tiny-cpu", "str"]), r.stderr
