"""Driving the real ``gpulock`` command the way a user's scripts and cron lines do.

``Cli`` is one test's world: a private state folder, an environment stripped of anything the
developer's shell may have set (``GPULOCK_TICKET``, ``GPULOCK_CONFIG``, ``GPULOCK_SIMULATE``),
and every process it started, killed with its whole process group at the end of the test even
when the test fails.  Every ``gpulock`` is ``python -m gpulock`` in a fresh interpreter.

Holders block until the test lets them go: ``hold()`` runs ``gpulock run -- sh -c '...; exec
cat'`` with a pipe as stdin, and the GPU is released when the test closes that pipe.  Waits
poll a condition every 10 ms against a deadline and fail with a message saying what was
awaited and what the queue looked like.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import procs

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
GPULOCK = (sys.executable, "-m", "gpulock")
VENV_BIN = str(Path(sys.executable).parent)  # where the `gpulock` script lives, for CMDs
STRIPPED = ("GPULOCK_TICKET", "GPULOCK_CONFIG", "GPULOCK_SIMULATE", "GPULOCK_STATE_DIR")
POLL_S = 0.01
WAIT_S = 15.0  # "eventually", on a 2-core machine that may be busy with benchmarks
RUN_S = 20.0  # the longest any one command may take before the test fails

# A holder's command: say it runs (the file named by $0 appears), then block reading stdin
# until the test closes the pipe.  `exec` keeps one process, which inherits the claim.
HOLD_SH = ': > "$0"; exec cat >/dev/null'

# A process that waits for a file the test creates (at most 30 s, so nothing outlives a
# crashed test for long): argv READY RELEASE.  It creates READY once it runs.
WAITFILE_PY = """\
import os, sys, time
ready, release = sys.argv[1], sys.argv[2]
open(ready, "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(release):
    if time.monotonic() > deadline:
        sys.exit(99)
    time.sleep(0.01)
"""

# A command that traps SIGTERM: argv READY OUT.  On SIGTERM it writes OUT and exits 7.
TRAP_PY = """\
import signal, sys
ready, out = sys.argv[1], sys.argv[2]
def on_term(signum, frame):
    with open(out, "w") as f:
        f.write(f"signal {signum}")
    sys.exit(7)
signal.signal(signal.SIGTERM, on_term)
open(ready, "w").close()
sys.stdin.read()
"""


def wait_until(
    predicate: Callable[[], T], what: str | Callable[[], str], timeout_s: float = WAIT_S
) -> T:
    """``procs.wait_until`` with the CLI tests' argument order and default deadline."""
    return procs.wait_until(predicate, timeout_s, what)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_clean_error(r: Result, code: int) -> None:
    """Exit ``code``, one ``error:`` line, at most a ``hint:`` besides, never a traceback."""
    assert r.code == code, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert len(error_lines(r.stderr)) == 1, r.describe()
    others = [ln for ln in r.stderr.splitlines() if not ln.startswith(("error:", "hint:"))]
    assert others == [], r.describe()


@dataclass
class Result:
    args: Sequence[str]
    code: int
    stdout: str
    stderr: str
    wall_s: float

    def describe(self) -> str:
        return (
            f"gpulock {' '.join(self.args)} -> exit {self.code} in {self.wall_s:.2f} s\n"
            f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"
        )

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError:
            raise AssertionError(f"not JSON:\n{self.describe()}") from None


@dataclass
class Proc:
    """A started process (in its own process group) with its output in files."""

    popen: subprocess.Popen[bytes]
    name: str
    out: Path
    err: Path
    ready: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def release(self) -> None:
        """Close the pipe the holder's command reads: it ends and the GPU is given back."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()

    def wait(self, timeout_s: float = RUN_S) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {self.name} (pid {self.pid}) "
                f"to exit\n{self.output()}"
            ) from None

    def output(self) -> str:
        def text(p: Path) -> str:
            try:
                return p.read_text(errors="replace")
            except OSError:
                return ""

        return f"--- {self.name} stdout ---\n{text(self.out)}--- stderr ---\n{text(self.err)}"

    def kill_group(self) -> None:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Cli:
    root: Path
    simulate: str | None = "24GiB"
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = self.root / "state"
        self.home = self.root / "home"
        self.home.mkdir(exist_ok=True)

    # -- environment --

    def env(self, **extra: str | None) -> dict[str, str]:
        """The environment of a user's shell: this test's state folder, nothing inherited."""
        env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
        env["GPULOCK_STATE_DIR"] = str(self.state)
        env["HOME"] = str(self.home)  # no ~/.config/gpulock/config.yaml from the real home
        env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        # This checkout's code, whatever an editable install points at (a worktree's tests
        # must run the worktree, not the main checkout the venv was installed from).
        env["PYTHONPATH"] = str(REPO)
        if self.simulate is not None:
            env["GPULOCK_SIMULATE"] = self.simulate
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def script(self, name: str, text: str) -> Path:
        path = self.root / name
        if not path.exists():
            path.write_text(text)
        return path

    # -- running commands --

    def run(
        self,
        *args: str,
        input: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = RUN_S,
        argv0: Sequence[str] = GPULOCK,
        cwd: Path | None = None,
    ) -> Result:
        """Run ``gpulock ARGS`` to completion (killed with its group past ``timeout_s``)."""
        argv = [*argv0, *args]
        start = time.monotonic()
        p = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env() if env is None else env,
            cwd=cwd or self.root,
            start_new_session=True,
        )
        try:
            out, err = p.communicate(None if input is None else input.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate()
            raise AssertionError(
                f"{' '.join(argv)} still running after {timeout_s:g} s: killed\n"
                f"--- stdout ---\n{out.decode(errors='replace')}"
                f"--- stderr ---\n{err.decode(errors='replace')}\n{self.describe()}"
            ) from None
        return Result(
            args,
            p.returncode,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            time.monotonic() - start,
        )

    def start(
        self,
        argv: Sequence[str],
        name: str,
        *,
        env: dict[str, str] | None = None,
        ready: Path | None = None,
    ) -> Proc:
        """Start a process in its own group, stdin a pipe the test holds, output in files."""
        out = self.root / f"{name}.stdout"
        err = self.root / f"{name}.stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=fo,
                stderr=fe,
                env=self.env() if env is None else env,
                cwd=self.root,
                start_new_session=True,
            )
        proc = Proc(popen, name, out, err, ready)
        self.procs.append(proc)
        return proc

    def start_run(self, name: str, *run_args: str, cmd: Sequence[str]) -> Proc:
        """``gpulock run --name NAME RUN_ARGS -- CMD``, not waited for."""
        return self.start([*GPULOCK, "run", "--name", name, *run_args, "--", *cmd], name)

    def hold(self, name: str, *run_args: str, gpu: int | str = 0) -> Proc:
        """A ``gpulock run`` whose command holds the GPU until ``release()``; returns once
        the command runs (so the GPU is granted and the command holds the claim)."""
        ready = self.root / f"{name}.ready"
        proc = self.start_run(
            name, "--gpu", str(gpu), *run_args, cmd=["sh", "-c", HOLD_SH, str(ready)]
        )
        proc.ready = ready
        self.wait_ready(proc)
        return proc

    def wait_ready(self, proc: Proc, path: Path | None = None) -> None:
        target = path or proc.ready
        assert target is not None

        def ok() -> bool:
            if target.exists():
                return True
            if proc.popen.poll() is not None:
                raise AssertionError(
                    f"{proc.name} exited ({proc.popen.returncode}) before {target.name} "
                    f"appeared\n{proc.output()}"
                )
            return False

        wait_until(ok, lambda: f"{target.name} of {proc.name}\n{self.describe()}")

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.kill_group()

    # -- looking at the state --

    def gpu_dir(self, gpu: int = 0) -> Path:
        return self.state / f"gpu{gpu}"

    def queue_files(self, gpu: int = 0) -> list[str]:
        try:
            return sorted(os.listdir(self.gpu_dir(gpu)))
        except FileNotFoundError:
            return []

    def status(self) -> dict[str, Any]:
        r = self.run("status", "--json")
        assert r.code == 0, r.describe()
        data: dict[str, Any] = r.json()
        return data

    def entries(self, gpu: int = 0) -> list[dict[str, Any]]:
        """Holders then waiters of one GPU, as ``gpulock status --json`` lists them."""
        for g in self.status()["gpus"]:
            if g["gpu"] == gpu:
                return list(g["holders"]) + list(g["waiters"])
        return []

    def entry(self, name: str, gpu: int = 0) -> dict[str, Any] | None:
        return next((e for e in self.entries(gpu) if e["name"] == name), None)

    def events(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The event log, read directly (no subprocess: cheap enough to poll)."""
        out = []
        for path in (self.state / "events.jsonl.1", self.state / "events.jsonl"):
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                continue
            for line in lines:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if kind is not None and e.get("event") != kind:
                    continue
                if all(e.get(k) == v for k, v in match.items()):
                    out.append(e)
        return out

    def wait_event(self, kind: str, timeout_s: float = WAIT_S, **match: Any) -> dict[str, Any]:
        found = wait_until(
            lambda: self.events(kind, **match),
            lambda: f"event {kind!r} with {match}\n{self.describe()}",
            timeout_s,
        )
        return found[0]

    def describe(self) -> str:
        lines = ["--- queue ---", *self.queue_files()]
        lines += ["--- events ---", *map(json.dumps, self.events())]
        lines += [p.output() for p in self.procs]
        return "\n".join(lines)


pid_alive = procs.alive  # True while a pid exists and is not a zombie
