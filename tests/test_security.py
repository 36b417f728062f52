"""A group-shared state folder with a real second user (``nobody``): forged tickets are never
believed or acted on, and a group member can queue, wait, hold and release.

The second user is real: its processes run under ``setpriv --reuid=nobody --regid=nogroup
--clear-groups``, sharing the state folder through the group ``nogroup``, so the kernel's
permission checks are the ones a user meets.  That needs root; elsewhere these tests skip and
say why.  Every process started here is killed with its group at the end.

``nobody`` may not be able to read the checkout or its venv (a clone in ``mktemp -d`` or
``/root`` is 0700), so it runs a copy: this checkout's ``gpulock`` and PyYAML, copied once into
a world-readable temporary folder, under a Python interpreter it can run (``NobodyPython``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import GPULOCK, Cli, Result, error_lines, wait_until

import gpulock as gpulock_pkg
from gpulock.core import identity, proof

GROUP = "nogroup"
USER = "nobody"
AS_NOBODY = ("setpriv", f"--reuid={USER}", f"--regid={GROUP}", "--clear-groups")


def _why_no_second_user() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to run processes as a second user (nobody) with setpriv"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux) to run processes as a second user"
    try:
        pwd.getpwnam(USER)
        import grp

        grp.getgrnam(GROUP)
    except KeyError:
        return f"needs the user {USER!r} and the group {GROUP!r}"
    return None


pytestmark = pytest.mark.skipif(
    _why_no_second_user() is not None, reason=str(_why_no_second_user())
)

NOBODY_UID = pwd.getpwnam(USER).pw_uid if _why_no_second_user() is None else -1


@dataclass(frozen=True)
class NobodyPython:
    """A Python interpreter ``nobody`` can run, and a folder of code it can read to put on its
    ``PYTHONPATH``: a copy of this checkout's ``gpulock`` and of PyYAML."""

    python: str
    site: Path

    def argv(self, *args: str) -> tuple[str, ...]:
        """``python ARGS`` as ``nobody``, the copy (nothing of the checkout) on its path."""
        return (*AS_NOBODY, "env", f"PYTHONPATH={self.site}", self.python, "-P", *args)


def _interpreters() -> list[str]:
    """Interpreters to try, this one's own first: the venv's python may lie in a folder that
    nobody cannot enter, the interpreter it was made from perhaps not."""
    found: list[str] = []
    base = getattr(sys, "_base_executable", None) or sys.executable
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (
        os.path.realpath(base),
        os.path.realpath(sys.executable),
        shutil.which(minor, path="/usr/local/bin:/usr/bin:/bin"),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"),
    ):
        if candidate and candidate not in found:
            found.append(candidate)
    return found


# What nobody's interpreter must manage before the tests trust it: import the copied code (and
# be new enough for it), from a folder that is nobody's to read.
PROBE_PY = "import sys, gpulock.cli, yaml; assert sys.version_info >= (3, 11), sys.version"


@pytest.fixture(scope="session")
def nobody_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NobodyPython]:
    import yaml

    # Not tmp_path_factory's folder: pytest makes its base 0700, which nobody cannot enter.
    base = Path(tempfile.mkdtemp(prefix="gpulock-nobody-"))
    try:
        base.chmod(0o755)
        site = base / "site"
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(Path(gpulock_pkg.__file__).parent, site / "gpulock", ignore=skip)
        shutil.copytree(Path(yaml.__file__).parent, site / "yaml", ignore=skip)
        # Whatever the umask and the modes in the checkout: every user may read the copy.
        for folder, dirs, files in os.walk(base):
            for name in dirs:
                (Path(folder) / name).chmod(0o755)
            for name in files:
                (Path(folder) / name).chmod(0o644)
        tried: list[str] = []
        for python in _interpreters():
            runtime = NobodyPython(python, site)
            r = subprocess.run(
                [*runtime.argv("-c", PROBE_PY)], cwd=base, capture_output=True, text=True
            )
            if r.returncode == 0:
                yield runtime
                return
            last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            tried.append(f"{python}: {last}")
        pytest.skip(
            f"no Python interpreter that user {USER!r} may run could import a world-readable "
            f"copy of gpulock and PyYAML in {site} (tried {'; '.join(tried)}): install "
            f"python3 where every user can read it (apt-get install python3)"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


# Run as nobody: make a FIFO named as ticket SEQ's claim and hold it open (so the ticket looks
# alive), then publish a ticket that says what the forger wants: any uid, any pid and its start
# time copied from /proc, granted long ago with a lease long run out (so it looks hung).
FORGE_PY = """\
import json, os, socket, sys, time
gpu_dir, seq, uid, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fifo = os.path.join(gpu_dir, f"{seq:012d}.fifo")
os.mkfifo(fifo, 0o660)
fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
with open(f"/proc/{pid}/stat", "rb") as f:
    ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
now = time.time()
ticket = {
    "format": "gpulock.ticket/1", "seq": seq, "gpu": 0, "pid": pid, "uid": uid,
    "user": "root" if uid == 0 else "nobody", "host": socket.gethostname(), "name": "forged",
    "created_wall": now - 100, "start_ticks": ticks,
    "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
    "pidns": os.readlink("/proc/self/ns/pid"), "command": ["sleep"], "need_bytes": None,
    "lease_s": 1.0, "granted_wall": now - 100, "child_pid": None, "child_start_ticks": None,
}
path = os.path.join(gpu_dir, f"{seq:012d}.ticket")
with open(path + ".part", "w") as f:
    json.dump(ticket, f)
os.utime(path + ".part", (now - 100, now - 100))  # no heartbeat for 100 s
os.rename(path + ".part", path)
sys.stdin.read()
"""


@dataclass
class Shared(Cli):
    """A ``Cli`` on a state folder shared with group ``nogroup`` that ``nobody`` can reach."""

    on_hung: str = "report"
    nobody: NobodyPython | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.config = self.root / "config.yaml"
        self.config.write_text(f"group: {GROUP}\non_hung: {self.on_hung}\nhung_grace: 1s\n")
        self.config.chmod(0o644)

    def env(self, **extra: str | None) -> dict[str, str]:
        return super().env(GPULOCK_CONFIG=str(self.config), **extra)

    def as_nobody(self, *args: str, umask: int = 0o077) -> Result:
        """``gpulock ARGS`` as the second user, under its own ``umask``."""
        return self.run(*args, argv0=self.nobody_argv(umask))

    def nobody_argv(self, umask: int = 0o077) -> tuple[str, ...]:
        """``gpulock`` as the second user, from the copy it can read (``NobodyPython``)."""
        assert self.nobody is not None
        code = (
            f"import os, runpy; os.umask({umask:#o}); "
            "runpy.run_module('gpulock', run_name='__main__', alter_sys=True)"
        )
        return self.nobody.argv("-c", code)

    def start_python_as_nobody(self, args: list[str], name: str) -> Any:
        """``python ARGS`` as the second user (a forger's script), not waited for."""
        assert self.nobody is not None
        return self.start(list(self.nobody.argv(*args)), name)


@pytest.fixture
def shared(
    isolated_env: None, nobody_python: NobodyPython, request: pytest.FixtureRequest
) -> Iterator[Shared]:
    # Not tmp_path: pytest makes its base folder 0700, which nobody cannot enter.
    base = Path(tempfile.mkdtemp(prefix="gpulock-shared-"))
    base.chmod(0o755)
    on_hung = getattr(request, "param", "report")
    c = Shared(base, on_hung=on_hung, nobody=nobody_python)
    try:
        # Root makes the folder, under a umask that would have left .seq 0640 before.
        r = c.run("run", "--", "true", argv0=("sh", "-c", 'umask 027; exec "$@"', "sh", *GPULOCK))
        assert r.code == 0, r.describe()
        yield c
    finally:
        c.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _victim(c: Cli) -> Any:
    """A process of root's that has nothing to do with gpulock."""
    return c.start(["sleep", "600"], "victim")


def _forge(c: Shared, seq: int, uid: int, pid: int) -> Any:
    forger = c.start_python_as_nobody(
        ["-c", FORGE_PY, str(c.gpu_dir()), str(seq), str(uid), str(pid)], "forger"
    )
    ticket = c.gpu_dir() / f"{seq:012d}.ticket"
    wait_until(lambda: ticket.exists() or forger.popen.poll() is not None, "the forged ticket")
    assert ticket.exists(), forger.output()
    assert os.stat(ticket).st_uid == NOBODY_UID
    return forger


def _alive(proc: Any) -> bool:
    return bool(proc.popen.poll() is None)


def _kills_of(c: Cli, pid: int) -> list[dict[str, Any]]:
    return [e for e in c.events("kill") if e.get("pid") == pid]


# --- 1. forged tickets -----------------------------------------------------------------------


def test_a_ticket_claiming_another_uid_is_shown_as_foreign_garbage(shared: Shared) -> None:
    victim = _victim(shared)
    _forge(shared, 1, 0, victim.pid)  # nobody's file, says it is root's

    [gpu] = shared.status()["gpus"]
    assert gpu["holders"] == [] and gpu["waiters"] == [], gpu
    [ignored] = gpu["ignored"]
    assert ignored["file"] == "000000000001.ticket"
    assert "foreign" in ignored["reason"] and f"uid {NOBODY_UID}" in ignored["reason"]
    r = shared.run("status")
    assert r.code == 0 and "foreign" in r.stdout and "forged" not in r.stdout, r.describe()
    assert _alive(victim)


@pytest.mark.parametrize("claimed_uid", [0, NOBODY_UID], ids=["claims-root", "claims-nobody"])
def test_break_stale_never_kills_a_process_named_by_a_forged_ticket(
    shared: Shared, claimed_uid: int
) -> None:
    victim = _victim(shared)
    _forge(shared, 1, claimed_uid, victim.pid)

    r = shared.run("break", "--stale")
    assert "Traceback" not in r.stderr, r.describe()
    if claimed_uid == NOBODY_UID:  # honest about its owner, but its pid holds no claim
        assert "does not hold the ticket's claim" in r.stdout, r.describe()
    assert _alive(victim), r.describe()
    assert _kills_of(shared, victim.pid) == [], shared.describe()
    forged = shared.gpu_dir() / "000000000001.ticket"
    if claimed_uid == 0:  # foreign garbage: cleaned like garbage
        assert "ticket 1 (gpu0): removed: garbage: foreign" in r.stdout, r.describe()
        assert not forged.exists()
    else:  # a live claim whose pid is unproven: skipped, left for its owner
        assert r.code == 1 and forged.exists(), r.describe()


@pytest.mark.parametrize("claimed_uid", [0, NOBODY_UID], ids=["claims-root", "claims-nobody"])
def test_break_force_never_kills_a_process_named_by_a_forged_ticket(
    shared: Shared, claimed_uid: int
) -> None:
    victim = _victim(shared)
    _forge(shared, 1, claimed_uid, victim.pid)

    r = shared.run("break", "1", "--force", "--grace", "1")
    assert r.code == 1 and "Traceback" not in r.stderr, r.describe()
    [line] = error_lines(r.stderr)
    want = "foreign" if claimed_uid == 0 else "does not hold the ticket's claim"
    assert want in line, r.describe()
    assert _alive(victim)
    assert _kills_of(shared, victim.pid) == [], shared.describe()


@pytest.mark.parametrize("shared", ["kill"], indirect=True)
@pytest.mark.parametrize("claimed_uid", [0, NOBODY_UID], ids=["claims-root", "claims-nobody"])
def test_a_waiter_with_on_hung_kill_never_kills_a_process_named_by_a_forged_ticket(
    shared: Shared, claimed_uid: int
) -> None:
    victim = _victim(shared)
    _forge(shared, 1, claimed_uid, victim.pid)

    r = shared.run("run", "--timeout", "4", "--name", "waiter", "--", "true")
    if claimed_uid == 0:
        assert r.code == 0, r.describe()  # foreign garbage holds nothing: granted at once
    else:
        assert r.code == 75, r.describe()  # a live claim it may not end: it waits, times out
        [stale] = shared.events("stale", ticket=1)
        assert "unproven" in stale["why_not"], stale
    assert _alive(victim)
    assert _kills_of(shared, victim.pid) == [], shared.describe()


# --- 2. the proof itself ---------------------------------------------------------------------

HOLD_PY = """\
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_NONBLOCK)
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_proof_wants_the_read_end_the_uid_and_the_start_time(tmp_path: Path) -> None:
    fifo = tmp_path / "000000000001.fifo"
    os.mkfifo(fifo, 0o600)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_PY, str(fifo)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        me = os.getpid()
        watcher = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # a write end: a waiter's watch
        try:
            assert proof.holds_claim(holder.pid, fifo)
            assert not proof.holds_claim(me, fifo)  # holding the write end proves nothing
            assert not proof.holds_claim(stranger.pid, fifo)
        finally:
            os.close(watcher)
        ticks = identity.start_ticks(holder.pid)
        uid = os.geteuid()
        assert proof.proven(holder.pid, ticks, uid, fifo)
        assert not proof.proven(holder.pid, (ticks or 0) + 1, uid, fifo)  # another process
        assert not proof.proven(holder.pid, ticks, uid + 1, fifo)  # another user's
        ns = identity.pid_namespace()
        sticks = identity.start_ticks(stranger.pid)
        assert not proof.send(stranger.pid, sticks, uid, ns, fifo, signal.SIGTERM)
        assert stranger.poll() is None
        # A descendant of the proven owner that does not hold the claim itself (the command
        # of `gpulock run` that closed its inherited descriptor) is reached through it.
        assert not proof.send(stranger.pid, sticks, uid, ns, fifo, signal.SIGTERM, via=(me, 1))
        assert (
            proof.send(
                stranger.pid,
                sticks,
                uid,
                ns,
                fifo,
                signal.SIGTERM,
                via=(holder.pid, ticks),
            )
            is False
        )  # the holder is not the stranger's parent: refused
        assert stranger.poll() is None
        own_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # now I hold it: my child may go
        try:
            my_ticks = identity.start_ticks(me)
            assert proof.send(
                stranger.pid, sticks, uid, ns, fifo, signal.SIGTERM, via=(me, my_ticks)
            )
            assert stranger.wait(30) == -signal.SIGTERM
        finally:
            os.close(own_fd)
        assert proof.send(holder.pid, ticks, uid, ns, fifo, signal.SIGTERM)
        assert holder.wait(30) == -signal.SIGTERM
    finally:
        for p in (holder, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


# --- 3. group mode for the second user ---------------------------------------------------------


def _modes(state: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for folder, dirs, files in os.walk(state):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            out[str(path.relative_to(state))] = os.lstat(path).st_mode
    return out


def test_a_group_member_queues_waits_holds_and_releases_in_roots_folder(shared: Shared) -> None:
    st = os.lstat(shared.state)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o2770)

    r = shared.as_nobody("run", "--name", "alone", "--", "true")
    assert r.code == 0, r.describe()

    # root holds; nobody waits behind it, holds once root releases, and root waits for nobody.
    ready = shared.root / "held"
    root_holder = shared.start(
        [*GPULOCK, "run", "--name", "root-1", "--", "sh", "-c", ': > "$0"; exec cat', str(ready)],
        "root-1",
    )
    shared.wait_ready(root_holder, ready)
    member = shared.start(
        [
            *shared.nobody_argv(),
            "run",
            "--name",
            "member",
            "--timeout",
            "60",
            "--",
            "sh",
            "-c",
            "exec cat",
        ],
        "member",
    )
    wait_until(lambda: shared.entry("member"), "nobody's ticket in the queue")
    entry = shared.entry("member")
    assert entry is not None and (entry["user"], entry["state"]) == (USER, "waiting"), entry
    root_again = shared.start(
        [*GPULOCK, "run", "--name", "root-2", "--timeout", "60", "--", "true"], "root-2"
    )
    wait_until(lambda: shared.entry("root-2"), "root's second ticket in the queue")

    root_holder.release()
    assert root_holder.wait() == 0, root_holder.output()
    wait_until(lambda: (shared.entry("member") or {}).get("state") == "holding", "nobody holding")
    assert root_again.popen.poll() is None  # behind nobody, in arrival order
    member.release()
    assert member.wait() == 0, member.output()
    assert root_again.wait() == 0, root_again.output()
    order = [e["name"] for e in shared.events("acquire")]
    assert order[-3:] == ["root-1", "member", "root-2"], shared.describe()

    # Every file the others need is the group's to read and write, whoever made it and
    # whatever their umask (nobody's was 077, root's 027).
    for name, mode in _modes(shared.state).items():
        if stat.S_ISDIR(mode):
            assert stat.S_IMODE(mode) == 0o2770, (name, oct(mode))
        elif stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
            assert mode & 0o060 == 0o060, (name, oct(mode))


def test_a_group_member_gets_a_clear_error_where_the_folder_does_not_let_it_in(
    shared: Shared,
) -> None:
    seq = shared.state / ".seq"
    seq.chmod(0o640)  # as an older gpulock under root's umask 027 left it
    r = shared.as_nobody("run", "--", "true")
    assert r.code == 1 and "Traceback" not in r.stderr, r.describe()
    [line] = error_lines(r.stderr)
    assert str(seq) in line and "0640" in line, r.describe()


# --- 4. forged resident records and the governor's kills --------------------------------------

# Run as nobody: a resident record naming root's process (its pid and start time copied from
# /proc, so the owner key and claim path are the ones that process would have), with the claim
# FIFO made and held by nobody, so that the record looks alive.
FORGE_RECORD_PY = """\
import json, os, sys, time
folder, uid, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(f"/proc/{pid}/stat", "rb") as f:
    ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
owner = f"{pid}-{ticks}"
fifo = os.path.join(folder, f"owner-{owner}.fifo")
os.mkfifo(fifo, 0o660)
fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
now = time.time()
record = {
    "format": "gpulock.resident/1", "id": f"{owner}-1", "name": "forged", "gpu": 0,
    "owner": owner, "pid": pid, "uid": uid, "user": "x", "program": "sleep",
    "policy": "persistent", "loaded_wall": now - 100, "last_used_wall": now - 100,
    "start_ticks": ticks, "pidns": os.readlink("/proc/self/ns/pid"),
    "declared_bytes": 2 << 30, "in_use": True,
}
path = os.path.join(folder, f"{owner}-1.json")
with open(path + ".part", "w") as f:
    json.dump(record, f)
os.rename(path + ".part", path)
sys.stdin.read()
"""


@pytest.mark.parametrize("claimed_uid", [0, NOBODY_UID], ids=["claims-root", "claims-nobody"])
def test_the_governor_never_kills_a_process_named_by_a_forged_resident_record(
    shared: Shared, claimed_uid: int
) -> None:
    from gpulock.core.settings import load
    from gpulock.governor.effects import Effects
    from gpulock.governor.model import Action, GovernorConfig, Snapshot
    from gpulock.residents import registry

    settings = load(str(shared.config), shared.state)
    folder = registry.Registry(settings).path  # made by root, shared with the group
    victim = _victim(shared)
    shared.start_python_as_nobody(
        ["-c", FORGE_RECORD_PY, str(folder), str(claimed_uid), str(victim.pid)], "forger"
    )
    wait_until(lambda: list(folder.glob("*.json")), "the forged record")
    records = registry.Registry(settings, create=False).records(clean=False)
    if claimed_uid == 0:
        assert records == []  # foreign: its file is nobody's
        return
    [record] = records
    assert record.uid == NOBODY_UID
    action = Action(
        kind="force-evict",
        reason="test",
        gpu=0,
        resident=record.id,
        name=record.name,
        bytes=2 << 30,
        level=None,
        evidence={},
    )
    snap = Snapshot(now_wall=time.time(), local_minutes=0)
    cfg = GovernorConfig(force_kill=True, grace_s=0.3)
    [res] = Effects(settings).apply([action], snap, cfg)
    assert res["kill"]["outcome"] == "not-killed", res
    assert "does not hold the claim" in res["kill"]["detail"], res
    assert _alive(victim)
    assert _kills_of(shared, victim.pid) == [], shared.describe()
