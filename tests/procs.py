"""Real processes for the lock tests: a child program, a way to drive it, and waits with deadlines.

Run as a script (``python tests/procs.py '<json options>'``) this file is the child: it imports
gpulock, acquires with the options given, appends one record per event to an audit file and is
driven through its stdin (one line per step), so how long it holds the GPU is decided by the
test, never by a sleep.  Imported, it is the test side: ``World`` starts children in their own
process groups, reads the audit file and the state folder, and kills every leftover child.

Audit records are single lines written with one ``write()`` on an ``O_APPEND`` descriptor::

    <kind> <name> <ticket or -> <time.monotonic_ns()> <JSON object>

``grant`` is written after ``acquire()`` returned and ``release`` before ``release()`` is
called, so a recorded interval always lies inside the real one: recorded intervals that
overlap prove that two processes really held the GPU at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gpulock.core.settings import Settings

T = TypeVar("T")

CHILD = Path(__file__).resolve()
POLL_S = 0.005
DEFAULT_WAIT_S = 15.0  # "it eventually happens", on a busy 2-core machine


# The start of a child script that lets go of any claim it inherited (a .fifo descriptor, as
# from `gpulock run`), as a program that closes the descriptors it does not know does.
DROP_CLAIMS_PY = """\
import os
for name in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{name}").endswith(".fifo"):
            os.close(int(name))
    except OSError:
        pass
"""

# A process that is on its way out and takes its time, as a GPU process is while the driver
# tears its context down: it lets go of any claim it inherited, creates the file argv[1], and its
# main thread exits while a second thread lives on until stdin closes.  Meanwhile the kernel
# shows the process in exit (a zombie leader, PF_EXITING) and its pidfd is not readable; only
# when that thread ends has it exited.
IN_EXIT_PY = (
    DROP_CLAIMS_PY
    + """\
import ctypes, sys, threading
def last_thread():
    sys.stdin.buffer.read()
    os._exit(0)
threading.Thread(target=last_thread).start()
open(sys.argv[1], "w").close()
ctypes.CDLL(None).pthread_exit(None)
"""
)


def in_exit(pid: int) -> bool:
    """True once the kernel shows ``pid`` inside its exit (or gone)."""
    from gpulock.core import identity
    from gpulock.lock import exitwait

    seen = exitwait.proc_state(pid, identity.start_ticks(pid))
    return seen is None or exitwait.in_exit(seen)


# --- waiting ---------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], T | None], timeout_s: float, what: str | Callable[[], str]
) -> T:
    """Poll ``predicate`` every few ms until it returns something truthy, and return that.

    Fails with an AssertionError naming ``what`` (a text, or a callable giving one, for
    details known only at the deadline) when ``timeout_s`` passes first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {text}")
        time.sleep(POLL_S)


# --- audit records ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    kind: str
    name: str
    ticket: int | None
    ns: int
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind} {self.name} {self.ticket} {self.ns}"


def read_audit(path: Path) -> list[Record]:
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        kind, name, ticket, ns, extra = line.split(" ", 4)
        out.append(
            Record(kind, name, None if ticket == "-" else int(ticket), int(ns), json.loads(extra))
        )
    return out


@dataclass(frozen=True)
class Interval:
    name: str
    ticket: int
    start: int
    end: int
    need_bytes: int | None
    gpus: tuple[int, ...] = (0,)


def intervals(records: list[Record], killed: dict[str, int] | None = None) -> list[Interval]:
    """Grant-release pairs per ticket; a grant without a release lasts until now.

    ``killed`` maps the names of holders a test killed to the time it sent the signal: their
    hold lasted at least that long (they could write no release record).
    """
    killed = killed or {}
    starts: dict[int, Record] = {}
    out = []
    for r in records:
        if r.kind == "grant" and r.ticket is not None:
            starts[r.ticket] = r
        elif r.kind == "release" and r.ticket in starts:
            g = starts.pop(r.ticket)
            out.append(_interval(g, r.ns))
    now = time.monotonic_ns()
    for g in starts.values():
        out.append(_interval(g, killed.get(g.name, now)))
    return sorted(out, key=lambda i: i.start)


def _interval(grant: Record, end: int) -> Interval:
    gpus = tuple(grant.extra.get("gpus") or (0,))
    return Interval(
        grant.name, grant.ticket or 0, grant.ns, end, grant.extra.get("need_bytes"), gpus
    )


def overlapping(ivs: list[Interval]) -> list[tuple[Interval, Interval]]:
    """Pairs of holds that overlap in time on a GPU they share."""
    return [
        (a, b)
        for i, a in enumerate(ivs)
        for b in ivs[i + 1 :]
        if b.start < a.end and set(a.gpus) & set(b.gpus)
    ]


# --- the child program -----------------------------------------------------------------------


class _Audit:
    def __init__(self, path: str, name: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.name = name

    def write(self, kind: str, ticket: int | None = None, **extra: Any) -> None:
        t = "-" if ticket is None else str(ticket)
        line = f"{kind} {self.name} {t} {time.monotonic_ns()} {json.dumps(extra)}\n"
        os.write(self.fd, line.encode())  # one write() on O_APPEND: never interleaved


def _read_line(heartbeat: Callable[[], None] | None = None, every_s: float = 0.05) -> bytes:
    """One line from stdin, unbuffered; b"" at EOF.  Calls ``heartbeat`` while it waits."""
    import select

    line = b""
    while not line.endswith(b"\n"):
        if heartbeat is not None:
            ready, _, _ = select.select([0], [], [], every_s)
            if not ready:
                heartbeat()
                continue
        ch = os.read(0, 1)
        if not ch:
            break
        line += ch
    return line


def _decorated_job(audit: _Audit) -> int:
    audit.write("enter", pid=os.getpid())
    _read_line()
    audit.write("exit")
    return 7


def child_main(opts: dict[str, Any]) -> int:
    import gpulock

    name = opts["name"]
    audit = _Audit(opts["audit"], name)
    kw: dict[str, Any] = {
        "gpu": opts.get("gpu", 0),
        "gpus": opts.get("gpus"),
        "need": opts.get("need"),
        "timeout": opts.get("timeout"),
        "lease": opts.get("lease"),
        **{k: opts[k] for k in ("prefetch", "prefer") if k in opts},
        "config": opts.get("config"),
    }
    mode = opts.get("mode", "hold")
    if opts.get("gate"):  # started ahead of time; queue only when told
        _read_line()
    if mode == "decorator":
        job = gpulock.locked(**kw)(_decorated_job)
        result = job(audit)
        audit.write("returned", result=result)
        return 0
    try:
        lease = gpulock.acquire(name=name, **kw)
    except gpulock.LockTimeout as e:
        audit.write(
            "timeout",
            gpu=e.gpu,
            waited_s=e.waited_s,
            holder_pid=e.holder_pid,
            holder_name=e.holder_name,
        )
        if opts.get("linger"):
            _read_line()
        return 3
    except gpulock.GpulockError as e:
        audit.write("error", type=type(e).__name__, message=str(e))
        return 4
    seq = lease.ticket
    audit.write(
        "grant",
        seq,
        pid=os.getpid(),
        need_bytes=lease.need_bytes,
        waited=lease.waited_s,
        gpus=list(lease.gpus),
        cuda=lease.cuda_visible_devices,
    )
    if mode == "nested":
        inner = gpulock.acquire(name=name + "-inner", **kw)
        audit.write("nested", seq, same=inner is lease, inner_ticket=inner.ticket)
        _read_line()
        inner.release()
        audit.write("inner-released", seq, held=lease.held)
    elif mode == "fork":
        pid = os.fork()
        if pid == 0:  # the forked child: lives on, blocked, until its group is killed
            try:
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        audit.write("forked", seq, pid=pid)
    beat = lease.heartbeat if opts.get("heartbeat") else None
    _read_line(beat, opts.get("heartbeat") or 0.05)
    audit.write("release", seq)
    lease.release()
    if opts.get("linger"):
        _read_line()
    return 0


# --- the test side ---------------------------------------------------------------------------


class Child:
    """One child process, in its own process group, driven line by line through its stdin."""

    def __init__(
        self, world: World, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.world = world
        self.name = name
        self.stderr_path = world.root / f"{name}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, **(env or {})},
                cwd=world.root,
                start_new_session=True,
            )
        self.seq: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str = "go") -> None:
        """One step forward: the child reads one line per step (release, then leave...)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def release(self) -> None:
        self.send("release")

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait_exit(self, timeout_s: float = DEFAULT_WAIT_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {self.name} to exit\n{self.stderr()}"
            ) from None

    def stderr(self) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"--- {self.name} stderr ---\n{text}" if text else ""

    def cleanup(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.killpg(signal.SIGKILL)  # also a forked grandchild, and a stopped process
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


class World:
    """One test's state folder, config file, audit file and children."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.audit = root / "audit.log"
        self.config = root / "gpulock.yaml"
        self.config.write_text("# every default\n")
        self.children: list[Child] = []

    # -- starting children --

    def spawn(self, name: str, env: dict[str, str] | None = None, **opts: Any) -> Child:
        """Start a child (``env``: variables added to this process's environment for it)."""
        opts = {"name": name, "audit": str(self.audit), "config": str(self.config), **opts}
        child = Child(self, name, [sys.executable, str(CHILD), json.dumps(opts)], env)
        self.children.append(child)
        return child

    def sleeper(self, name: str = "sleeper") -> Child:
        """A live process that has nothing to do with gpulock: it blocks reading its stdin."""
        child = Child(self, name, [sys.executable, "-c", "import sys; sys.stdin.read()"])
        self.children.append(child)
        return child

    def enqueue(self, name: str, gpu: Any = 0, **opts: Any) -> Child:
        """Start a child and return once its ticket is in the queue: arrival order is known.

        ``gpu``: an index, a list of them or "any" (then a copy in any GPU's folder will do:
        every copy is in place before the next ticket can be numbered, and one granted at
        once keeps only the copies of the GPUs it holds).
        """
        child = self.spawn(name, gpu=gpu, **opts)
        where = [gpu] if isinstance(gpu, int) else (list(gpu) if isinstance(gpu, list) else None)
        child.seq = self.wait_ticket(child, where[0] if where and len(where) == 1 else where)
        return child

    def hold(self, name: str, **opts: Any) -> Child:
        """Start a child and return once it holds the GPU."""
        child = self.enqueue(name, **opts)
        self.wait_record("grant", name)
        return child

    def queued(self, name: str, **opts: Any) -> Child:
        """Start a child and return once it has looked at the queue and decided to wait."""
        child = self.enqueue(name, **opts)

        def decided() -> bool:
            if self.find_record("grant", name):  # fail at once, not at the deadline
                raise AssertionError(f"{name} was granted, it should wait\n{self.describe()}")
            return bool(self.events("wait", ticket=child.seq))

        wait_until(decided, DEFAULT_WAIT_S, lambda: f"{name} to decide to wait\n{self.describe()}")
        return child

    # -- looking at the world --

    def gpu_dir(self, gpu: int = 0) -> Path:
        return self.state / f"gpu{gpu}"

    def tickets(self, gpu: int = 0) -> dict[int, Any]:
        """Readable tickets in the queue folder, by sequence number (garbage skipped)."""
        from gpulock.lock.ticket import TicketFormatError, parse, seq_of

        out = {}
        try:
            names = os.listdir(self.gpu_dir(gpu))
        except FileNotFoundError:
            return {}
        for n in names:
            seq = seq_of(n)
            if seq is None:
                continue
            try:
                out[seq] = parse(_read_regular(self.gpu_dir(gpu) / n))
            except (OSError, TicketFormatError):
                continue
        return out

    def wait_ticket(
        self, child: Child, gpu: int | list[int] | None = 0, timeout_s: float = DEFAULT_WAIT_S
    ) -> int:
        """``child``'s ticket number, once in ``gpu``'s folder (a list: in any of them; None:
        in any GPU's folder)."""

        def find() -> int | None:
            if child.proc.poll() is not None:
                raise AssertionError(
                    f"{child.name} exited ({child.proc.returncode}) before queueing\n"
                    f"{child.stderr()}\n{self.describe()}"
                )
            if isinstance(gpu, int):
                folders = [gpu]
            elif gpu is not None:
                folders = gpu
            else:
                folders = sorted(int(p.name[3:]) for p in self.state.glob("gpu[0-9]*"))
            for g in folders:
                mine = [s for s, t in self.tickets(g).items() if t.pid == child.pid]
                if mine:
                    return mine[0]
            return None

        return wait_until(find, timeout_s, f"{child.name}'s ticket in {self.state} ({gpu})")

    def records(self) -> list[Record]:
        return read_audit(self.audit)

    def find_record(self, kind: str, name: str) -> Record | None:
        return next((r for r in self.records() if r.kind == kind and r.name == name), None)

    def wait_record(self, kind: str, name: str, timeout_s: float = DEFAULT_WAIT_S) -> Record:
        return wait_until(
            lambda: self.find_record(kind, name),
            timeout_s,
            lambda: f"audit record {kind!r} of {name}\n{self.describe()}",
        )

    def events(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        from gpulock.core import events

        return [
            e
            for e in events.read(self.state)
            if (kind is None or e["event"] == kind) and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_event(
        self, kind: str, timeout_s: float = DEFAULT_WAIT_S, **match: Any
    ) -> dict[str, Any]:
        found = wait_until(
            lambda: self.events(kind, **match),
            timeout_s,
            lambda: f"event {kind!r} with {match}\n{self.describe()}",
        )
        return found[0]

    def settings(self) -> Settings:
        from gpulock.core.settings import load

        return load(str(self.config), self.state)

    def snapshot(self) -> dict[str, Any]:
        from gpulock import status

        return status.snapshot(self.settings())

    def entries(self, gpu: int = 0) -> dict[int, dict[str, Any]]:
        """The status snapshot's holders and waiters of one GPU, by ticket."""
        for g in self.snapshot()["gpus"]:
            if g["gpu"] == gpu:
                return {e["ticket"]: e for e in g["holders"] + g["waiters"]}
        return {}

    def describe(self) -> str:
        """What a failing wait prints: the audit, the queue folder, the children's stderr."""
        lines = ["--- audit ---", *map(str, self.records())]
        try:
            folders = sorted(n for n in os.listdir(self.state) if n.startswith("gpu"))
        except OSError:
            folders = []
        for folder in folders or ["gpu0"]:
            try:
                lines += [f"--- queue {folder} ---", *sorted(os.listdir(self.state / folder))]
            except OSError:
                pass
        lines += [c.stderr() for c in self.children if c.stderr()]
        return "\n".join(lines)

    def cleanup(self) -> None:
        for child in self.children:
            child.cleanup()


def _read_regular(path: Path) -> bytes:
    """A small regular file's bytes; OSError for anything else (a FIFO must not block us)."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"


if __name__ == "__main__":
    sys.exit(child_main(json.loads(sys.argv[1])))
