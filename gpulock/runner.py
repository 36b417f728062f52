"""``gpulock run``: hold a GPU for exactly as long as a command and its children run.

* The command starts without a shell, with ``CUDA_VISIBLE_DEVICES`` set to the granted GPUs
  in order (and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA counts GPUs as NVML and
  ``nvidia-smi`` do: without it CUDA puts the fastest first, and gpu1 in ``gpulock status``
  can be device 0 in torch), ``GPULOCK_GPUS`` (the same list), ``GPULOCK_TICKET`` (so a
  nested ``gpulock.acquire`` or ``gpulock run`` on those GPUs is satisfied by this lease
  instead of queueing behind it) and ``GPULOCK_STATE_DIR``.
* It inherits the ticket's FIFO descriptors (one per GPU held): the kernel keeps the GPUs
  claimed while the command lives, even if this ``gpulock run`` process is SIGKILLed.
* This process becomes a child subreaper, so grandchildren that outlive the command are
  re-parented here and waited for before the GPU is released.
* SIGTERM, SIGHUP, SIGUSR1/2 are forwarded to the command; SIGINT and SIGQUIT too, except when
  they come from the terminal, which already delivered them to the whole foreground group.
* It never blocks in a plain ``waitpid``: a signal that lands just before such a call has its
  Python handler deferred until the call returns, i.e. until the command ends by itself (a
  SIGTERM right after the grant was lost that way).  Instead it sleeps in ``poll`` on the
  signal wake-up descriptor, which the C-level handler writes for every signal (SIGCHLD
  included), so a signal that arrives at any instant wakes it, and it reaps with ``WNOHANG``.
* A handler that raises is not enough on its own: CPython runs it at whatever bytecode comes
  next, and when that is inside a finalizer or a weakref callback (importlib runs one at the
  end of every import, gc runs ``__del__`` methods at any allocation) the exception is printed
  as "Exception ignored" and dropped.  So the leave-the-line handler first records the signal,
  and the runner checks that record before it starts the command; and everything it imports
  after the grant (ctypes, for the subreaper) is imported before it queues.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NoReturn

from gpulock.api import acquire
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.core.state import ENV_STATE_DIR
from gpulock.lock.gpuset import GpuArg
from gpulock.lock.inherit import ENV_GPUS, ENV_TICKET
from gpulock.lock.lease import Lease, leases_held

FORWARDED = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
PR_SET_CHILD_SUBREAPER = 36


class RunError(GpulockError):
    """The command could not be started; ``exit_code`` follows the shell's convention."""

    def __init__(self, message: str, exit_code: int, *, hint: str | None = None) -> None:
        self.exit_code = exit_code
        super().__init__(message, hint=hint)


class _Signalled(BaseException):
    """SIGTERM/SIGHUP while waiting in line: leave the queue cleanly, then exit 128+N."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def resolve(command: Sequence[str]) -> str:
    """The executable for command[0], or RunError(127/126) before we queue for nothing."""
    prog = command[0]
    found = shutil.which(prog)
    if found is not None:
        return found
    if "/" in prog:  # a path, not looked up in PATH: it is there or not
        if os.path.exists(prog):
            raise RunError(f"not executable: {prog}", 126)
        _no_such_file(prog)
    raise RunError(
        f"command not found: {prog}",
        127,
        hint="cron runs with a short PATH: give the absolute path",
    )


def _no_such_file(prog: str) -> NoReturn:
    where = os.path.dirname(os.path.abspath(prog))
    hint = (
        f"check the path ({where} does not exist)"
        if not os.path.isdir(where)
        else f"check the name (ls {where})"
    )
    raise RunError(f"no such file: {prog}", 127, hint=hint)


def run(
    settings: Settings,
    command: Sequence[str],
    *,
    gpu: GpuArg = None,
    gpus: int | None = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    prefetch: Sequence[str] = (),
) -> int:
    resolve(command)
    libc = _libc()  # imported now: an import after the grant is a window for a lost signal
    stopped: list[int] = []  # signals whose _Signalled may have been swallowed (see above)

    def leave(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        raise _Signalled(signum)

    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_wakeup: int | None = None
    previous: dict[int, Any] = {}
    try:
        try:
            for s in (signal.SIGTERM, signal.SIGHUP):
                previous.setdefault(s, signal.getsignal(s))  # first: restored whatever comes
                signal.signal(s, leave)
            held = acquire(
                gpu,
                need,
                timeout,
                name or os.path.basename(command[0]),
                lease,
                gpus=gpus,
                config=settings.config,
                state_dir=settings.state_dir,
                command=command,
                prefetch=prefetch,
            )
        except _Signalled as stop:
            # A signal checked at the very end of acquire() lands here with the lease
            # granted: give it back now rather than leave a granted ticket to a dying process.
            for granted in leases_held():
                granted.release()
            return 128 + stop.signum
        try:
            env = command_env(held, settings)
            _become_subreaper(libc)
            child: list[int] = []  # the command's pid, once it runs
            caught: list[int] = []  # signals that came before it did
            forward = _forwarder(child, caught)
            # Every signal with a Python handler now also writes a byte to wake_w, so the
            # wait below cannot sleep through one (see the module's docstring).
            old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
            # From here on no handler raises, so nothing can interrupt Popen or set_child and
            # leave the command running after we released the GPU.
            for sig in (*FORWARDED, signal.SIGCHLD):
                previous.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, _wake_only if sig == signal.SIGCHLD else forward)
            if stopped or caught:  # came after the grant: do not start the command at all
                return 128 + (stopped or caught)[0]
            # The command inherits the claims, so the GPUs stay claimed while it runs even if
            # this process dies.  A nested run passes on the descriptors it inherited, when it
            # has them; the outer ticket keeps its child_pid.
            fds = held.claim_fds
            try:
                proc = subprocess.Popen(list(command), env=env, pass_fds=fds)
            except OSError as e:
                raise RunError(f"cannot run {command[0]}: {e.strerror}", 126) from None
            child.append(proc.pid)
            for signum in caught:  # came while it started: it gets them now
                forward(signum, None)
            if not held.inherited:
                held.set_child(proc.pid)
            rc = _reap_all(proc.pid, wake_r, child)
            proc.returncode = rc  # reaped here, not by Popen: tell it, so it never waits
            return rc if rc >= 0 else 128 - rc
        except _Signalled as stop:  # arrived between the grant and the command's start
            return 128 + stop.signum
        finally:
            held.release()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
        os.close(wake_r)
        os.close(wake_w)


def command_env(lease: Lease, settings: Settings) -> dict[str, str]:
    """The environment of a command that runs on ``lease`` (``gpulock run``'s, a pool's
    worker): ours, with its GPU, its ticket and the state folder."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = lease.cuda_visible_devices  # "1,3": the granted, in order
    # gpulock numbers GPUs as NVML does (PCI bus order); CUDA's default is fastest first,
    # which on a mixed machine would put the job on a GPU it did not lock: always, then, even
    # over a FASTEST_FIRST inherited from the shell (the indices above are NVML's).
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env[ENV_GPUS] = lease.cuda_visible_devices
    env[ENV_TICKET] = f"{lease.gpu}:{lease.ticket}"
    env[ENV_STATE_DIR] = str(settings.state_dir)
    return env


def _forwarder(child: list[int], caught: list[int]) -> Callable[[int, FrameType | None], None]:
    def forward(signum: int, _frame: FrameType | None) -> None:
        if not child:  # the command is not running yet: remember, never raise
            caught.append(signum)
            return
        if signum in (signal.SIGINT, signal.SIGQUIT) and terminal_delivers():
            return
        targets = [] if child[0] <= 0 else [child[0]]  # <= 0 once reaped: its pid may be reused
        for pid in dict.fromkeys([*targets, *_children()]):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    return forward


def terminal_delivers() -> bool:
    """True when we run in the terminal's foreground group: the tty signalled everyone."""
    for stream in (sys.stdin, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _children() -> list[int]:
    """Our remaining children (re-parented grandchildren), from /proc."""
    me = str(os.getpid())
    out = []
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            out = [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def _libc() -> Any:
    """The C library, loaded before queueing; None where ctypes cannot load it."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (OSError, ImportError):
        return None


def _become_subreaper(libc: Any) -> None:
    try:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # without it, orphaned grandchildren are not waited for; the FIFO still is


def _wake_only(_signum: int, _frame: FrameType | None) -> None:
    """SIGCHLD: the wake-up byte is what matters; the handler has nothing to do."""


def _reap_all(command_pid: int, wake_fd: int, child: list[int]) -> int:
    """Wait for the command and then every orphan re-parented to us; the command's status.

    Sleeps only in ``poll`` on the wake-up descriptor: a child's exit (SIGCHLD) and a
    forwarded signal both write to it, even one that arrives just before ``poll`` is entered.
    """
    poller = select.poll()
    poller.register(wake_fd, select.POLLIN)
    rc: int | None = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left at all
            if rc is None:  # only this loop reaps, so this cannot happen; say so if it does
                raise RunError("lost track of the command's exit status", 1) from None
            return rc
        if pid == command_pid:
            rc = os.waitstatus_to_exitcode(status)
            child[0] = 0  # reaped: never signal that pid again
        if pid != 0:
            continue  # reap the next one, if any, before sleeping
        poller.poll()  # forwarded signals' handlers run when this returns
        try:
            while os.read(wake_fd, 512):
                pass
        except BlockingIOError:
            pass
