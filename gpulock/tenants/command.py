"""``kind: command``: a server gpulock starts on demand and stops to evict.

For servers that cannot unload a model (``llama-server -m``, ``python -m llama_cpp.server``, a
TTS or image server): starting it is ``gpulock run --need NEED --name tenant:NAME -- ARGV``,
detached, so the server holds a GPU ticket with its ``need`` while it waits for the GPU, starts
and serves, and the kernel drops the ticket however it ends.  Its output goes to
``<state>/tenants/NAME.log``.

* Listing: the ticket named ``tenant:NAME`` in the GPU's queue.  Waiting, or holding while
  ``health`` does not answer 200 yet: ``loading``; holding and healthy: ``loaded``; no ticket:
  nothing loaded.  Its size is ``need``; its pid the server's (the ticket's command).
* Load (``start``): spawn, then wait up to ``ready_timeout`` for ``health``; a server that
  exits first is a ``TenantError`` with its exit status and the log's last lines.
* Unload (``stop``): SIGTERM to the server and its ``gpulock run`` (which forwards it), up to
  ``stop_timeout`` for the ticket to go, then SIGKILL.  Signals go only to the recorded
  processes (pid + start time), never to a reused pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence

from gpulock.core import children, identity
from gpulock.core.settings import Settings
from gpulock.core.state import ensure_subdir
from gpulock.core.tenantspec import TenantSpec
from gpulock.lock.queuedir import QueueDir
from gpulock.lock.ticket import Ticket
from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import Client, TenantError

TICKET_PREFIX = "tenant:"


class CommandAdapter(Adapter):
    kind = "command"

    def __init__(
        self, spec: TenantSpec, *, timeout_s: float = 0.8, settings: Settings | None = None
    ) -> None:
        super().__init__(spec, timeout_s=timeout_s)
        if settings is None:
            raise ValueError("a command tenant needs the settings (its ticket is in the queue)")
        self.settings = settings

    def ticket(self) -> tuple[Ticket, bool] | None:
        """The server's ticket and whether its owner is alive; None when it is not running."""
        qdir = QueueDir(self.settings, self.spec.gpu, create=False)
        for seq, tf, _why in qdir.scan():
            mine = tf is not None and tf.ticket.name == TICKET_PREFIX + self.spec.name
            if mine and tf is not None and qdir.alive(seq):
                return tf.ticket, True
        return None

    def healthy(self, timeout_s: float | None = None) -> bool:
        url = self.spec.health_url
        if url is None:
            return True
        try:
            Client(url, timeout_s=timeout_s or self.timeout_s).request(
                "GET", url, expect_json=False
            )
        except TenantError:
            return False
        return True

    def list(self) -> Seen:
        found = self.ticket()
        if found is None:
            return Seen(actual_kind="command", notes=("not running",))
        t, _alive = found
        state = "loaded" if t.holding and self.healthy() else "loading"
        models = tuple(
            TenantModel(
                name=m,
                state=state,
                size_bytes=self.spec.need_bytes,
                pid=t.child_pid,
                detail=None if t.holding else "waiting for the GPU",
            )
            for m in self.spec.models
        )
        return Seen(actual_kind="command", models=models)

    # --- start -----------------------------------------------------------------------------

    def log_path(self) -> str:
        folder = ensure_subdir(self.settings.state_dir, "tenants", group=self.settings.group)
        return str(folder / f"{self.spec.name}.log")

    def load(  # a command server loads what its command says, whatever the model
        self, model: str | None = None, *, timeout_s: float | None = None, **_: object
    ) -> None:
        """Start the server (unless it runs) and wait until ``health`` answers."""
        if self.ticket() is None:
            self._spawn()
        self.wait_ready(timeout_s if timeout_s is not None else self.spec.ready_timeout_s)

    def run_argv(self) -> tuple[str, ...]:
        """``gpulock run`` around the server's command: its ticket holds ``need`` while the
        server starts and serves, and the model files its command names are warmed into the
        page cache while that ticket waits (``--prefetch``)."""
        argv = [
            *children.python("-m", "gpulock", "run"),
            "--gpu", str(self.spec.gpu),
            "--need", str(self.spec.need_bytes),
            "--name", TICKET_PREFIX + self.spec.name,
            "--state-dir", str(self.settings.state_dir),
        ]  # fmt: skip
        if self.settings.config.path is not None:
            argv += ["--config", str(self.settings.config.path)]
        for path in model_files(self.spec.command):
            argv += ["--prefetch", path]
        return (*argv, "--", *self.spec.command)

    def _spawn(self) -> None:
        argv = self.run_argv()
        log = os.open(self.log_path(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # Its own session: the server outlives the process that asked for it (a router call,
            # a CLI) and never gets that terminal's Ctrl-C.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        finally:
            os.close(log)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            proc = getattr(self, "proc", None)
            code = proc.poll() if proc is not None else None
            if code is not None:
                raise TenantError(
                    f"tenant {self.spec.name}: its server exited with status {code} while "
                    f"starting: {self._log_tail()}",
                    hint=f"its output: {self.log_path()}",
                )
            found = self.ticket()
            if found is not None and found[0].holding and self.healthy(timeout_s=1.0):
                return
            if proc is None and found is None:
                raise TenantError(f"tenant {self.spec.name}: its server is not running")
            if time.monotonic() >= deadline:
                raise TenantError(
                    f"tenant {self.spec.name}: not ready after {timeout_s:g} s "
                    f"({self.spec.health_url} never answered 200)",
                    hint=f"its output: {self.log_path()}; raise ready_timeout if it is slow",
                )
            time.sleep(pause)  # the server has no readiness notification: poll its health
            pause = min(pause * 2, 0.5)

    def _log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path(), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no output)"
        tail = [x.strip() for x in text.strip().splitlines()[-lines:] if x.strip()]
        return " | ".join(tail) or "(no output)"

    # --- stop ------------------------------------------------------------------------------

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        """Stop the server: SIGTERM, ``stop_timeout``, SIGKILL; returns how it ended."""
        found = self.ticket()
        if found is None:
            return "not running"
        t, _ = found
        if not identity.may_signal(t.uid):
            raise TenantError(f"not permitted: the server runs as uid {t.uid}")
        self._signal(t, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.stop_timeout_s
        while time.monotonic() < deadline:
            if self.ticket() is None:
                return "stopped (SIGTERM)"
            time.sleep(0.05)  # a process exit has no notification we can wait on here
        self._signal(t, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and self.ticket() is not None:
            time.sleep(0.05)
        return f"killed (SIGKILL after {self.spec.stop_timeout_s:g} s)"

    def _signal(self, t: Ticket, sig: int) -> None:
        # Only a process proven to hold the ticket's claim (a ticket named like ours is just
        # its writer's word: anyone in a shared folder can write one).
        from gpulock.lock.hung import signal_holder

        qdir = QueueDir(self.settings, self.spec.gpu, create=False)
        signal_holder(t, sig, qdir.fifo_path(t.seq))


MODEL_FLAGS = ("-m", "--model")  # llama.cpp's llama-server, python -m llama_cpp.server


def model_files(command: Sequence[str]) -> list[str]:
    """The model files a server's command names (after ``-m``/``--model``, as ``--model=P``,
    or any ``*.gguf`` argument) that are readable regular files, each once."""
    found: list[str] = []
    for i, arg in enumerate(command):
        path = None
        if arg in MODEL_FLAGS and i + 1 < len(command):
            path = command[i + 1]
        elif arg.startswith("--model="):
            path = arg.split("=", 1)[1]
        elif arg.endswith(".gguf"):
            path = arg
        if path and path not in found and os.path.isfile(path) and os.access(path, os.R_OK):
            found.append(path)
    return found
