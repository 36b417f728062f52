"""The README's tour, walked as written: where the command is, the routes its router and agent
commands need (``examples/tiny.yaml``), ``--module`` for your own agent, and one install path
for cron in the README and in ``crontab.example``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from cli_helpers import REPO

README = (REPO / "README.md").read_text()
VENV_BIN = Path(sys.executable).parent
INSTALLED = "/opt/gpulock/.venv/bin/gpulock"  # where crontab.example says gpulock is


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", README, flags=re.S)


def block_with(kind: str, text: str) -> str:
    (found,) = [b for b in blocks(kind) if text in b]
    return found


def test_the_tour_says_where_the_command_is() -> None:
    tour = README.split("## A 5-minute tour", 1)[1]
    assert tour.index(". .venv/bin/activate") < tour.index("$ gpulock run")


def test_the_cron_lines_share_crontab_examples_install_path() -> None:
    crontab = (REPO / "crontab.example").read_text()
    jobs = [ln for ln in crontab.splitlines() if ln and not ln.startswith(("#", " "))]
    assert any(INSTALLED in ln for ln in jobs)
    for block in blocks("cron"):
        for line in block.splitlines():
            words = line.split()
            gpulocks = [w for w in words if w.endswith("/gpulock")]
            assert gpulocks == [INSTALLED], line


class Shell:
    """Runs a console block's ``$`` lines as a user's shell would, in ``cwd``."""

    def __init__(self, cwd: Path, home: Path) -> None:
        self.cwd = cwd
        self.home = home
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
        env.update(HOME=str(home), PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
        env["PYTHONPATH"] = str(REPO)
        self.env = env

    def expand(self, word: str) -> str:
        word = word.replace("$PWD", str(self.cwd))
        return str(self.home) + word[1:] if word.startswith("~/") else word

    def run(self, block: str) -> dict[str, subprocess.CompletedProcess[str]]:
        done = {}
        for line in block.splitlines():
            if not line.startswith("$ "):
                continue
            words = [self.expand(w) for w in shlex.split(line[2:], comments=True)]
            if words[0] == "export":
                name, _, value = words[1].partition("=")
                self.env[name] = self.expand(value)
                continue
            if words[0] == "python":
                words[0] = sys.executable
            r = subprocess.run(
                words, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
            assert "Traceback" not in r.stderr, r.stderr
            done[line[2:].split("#")[0].strip()] = r
        return done


def test_walk_the_tiny_routes_and_your_own_agent(tmp_path: Path) -> None:
    work = tmp_path / "checkout"
    shutil.copytree(REPO / "examples", work / "examples", ignore=shutil.ignore_patterns("models"))
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "a.txt").write_text("Met Ana about the GPU queue.\n")
    (home / "agents").mkdir()
    code = block_with("python", '@agent("my-digest"')
    (home / "agents" / "digest.py").write_text(code)
    sh = Shell(work, home)

    tiny = block_with("console", "examples/tiny.yaml")
    done = sh.run(tiny)
    printed = tiny.split("$ gpulock route summarize --explain\n", 1)[1].split("$ ", 1)[0]
    assert done["gpulock route summarize --explain"].stdout == printed
    assert (work / "digest.md").read_text().startswith("# ")

    mine = block_with("console", "agent show my-digest")
    done = sh.run(mine)
    shown = json.loads(
        done["gpulock agent show my-digest --json --module ~/agents/digest.py"].stdout
    )
    assert shown["name"] == "my-digest" and shown["last_run"]["outcome"] == "ok"
    listed = done["gpulock agent list --module ~/agents/digest.py"].stdout
    assert "my-digest" in listed and "digest" in listed
