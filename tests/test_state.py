from __future__ import annotations

import grp
import os
import pathlib
import pwd
import stat
from collections.abc import Iterator

import pytest

from gpulock.core import state
from gpulock.core.config import Config
from gpulock.core.errors import NoStateDir, StateDirError
from gpulock.core.mounts import NETWORK_FS, fs_type_of
from gpulock.core.state import (
    dir_mode,
    ensure_state_dir,
    ensure_subdir,
    file_mode,
    resolve_state_dir,
)
from gpulock.core.statefile import atomic_write, open_regular, read_small, read_tail

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def mode_of(path: pathlib.Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def my_group() -> str:
    return grp.getgrgid(os.getgid()).gr_name


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """A umask that would strip the modes we ask for, to show they are set explicitly."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture(autouse=True)
def local_mounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Judge every test's folders as if on a local disk, whatever the test machine uses."""
    monkeypatch.setattr(state, "MOUNTINFO", "/nonexistent/mountinfo")


# --- modes -----------------------------------------------------------------------------------


def test_modes() -> None:
    assert file_mode(None) == 0o600
    assert file_mode("fleet") == 0o660
    assert dir_mode(None) == 0o700
    assert dir_mode("fleet") == 0o2770


# --- resolve_state_dir -----------------------------------------------------------------------


def test_default_is_under_home(tmp_path: pathlib.Path) -> None:
    assert resolve_state_dir(None, {"HOME": str(tmp_path)}) == tmp_path / ".local/state/gpulock"


def test_home_unset_falls_back_to_passwd() -> None:
    home = pathlib.Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert resolve_state_dir(None, {}) == home / ".local/state/gpulock"
    assert resolve_state_dir(None, {"HOME": ""}) == home / ".local/state/gpulock"


def test_xdg_variables_are_ignored(tmp_path: pathlib.Path) -> None:
    environ = {
        "HOME": str(tmp_path),
        "XDG_RUNTIME_DIR": "/run/user/1000",
        "XDG_STATE_HOME": "/elsewhere",
    }
    assert resolve_state_dir(None, environ) == tmp_path / ".local/state/gpulock"


def test_config_state_dir_is_used(tmp_path: pathlib.Path) -> None:
    config = Config(state_dir=tmp_path / "from-config")
    assert resolve_state_dir(config.state_dir, {"HOME": "/home/x"}) == tmp_path / "from-config"


def test_env_wins_over_config(tmp_path: pathlib.Path) -> None:
    config = Config(state_dir=tmp_path / "from-config")
    environ = {"HOME": "/home/x", "GPULOCK_STATE_DIR": str(tmp_path / "from-env")}
    assert resolve_state_dir(config.state_dir, environ) == tmp_path / "from-env"


def test_env_tilde_uses_the_given_home(tmp_path: pathlib.Path) -> None:
    environ = {"HOME": str(tmp_path), "GPULOCK_STATE_DIR": "~/gl"}
    assert resolve_state_dir(None, environ) == tmp_path / "gl"


def test_relative_env_is_made_absolute(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_state_dir(None, {"GPULOCK_STATE_DIR": "rel"}) == tmp_path / "rel"


def test_symlinks_are_not_resolved(tmp_path: pathlib.Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    environ = {"GPULOCK_STATE_DIR": str(tmp_path / "link")}
    assert resolve_state_dir(None, environ) == tmp_path / "link"


# --- ensure_state_dir ------------------------------------------------------------------------


def test_created_private(tmp_path: pathlib.Path, strict_umask: None) -> None:
    path = tmp_path / "a" / "b" / "state"
    assert ensure_state_dir(path) == path
    assert path.is_dir()
    assert mode_of(path) == 0o700
    assert os.lstat(path).st_uid == os.geteuid()


def test_created_shared(tmp_path: pathlib.Path, strict_umask: None) -> None:
    path = tmp_path / "shared"
    ensure_state_dir(path, group=my_group())
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o2770
    assert st.st_gid == grp.getgrnam(my_group()).gr_gid


def test_existing_folder_is_accepted_and_left_alone(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(0o750)
    ensure_state_dir(path)
    ensure_state_dir(path)
    assert mode_of(path) == 0o750


def test_group_writable_is_fine_in_private_mode(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(0o770)
    ensure_state_dir(path)


def test_symlink_is_refused(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(StateDirError) as caught:
        ensure_state_dir(link)
    assert caught.value.path == str(link)
    assert "is a symlink" in caught.value.reason
    assert caught.value.hint is not None


def test_dangling_symlink_is_refused_not_created(tmp_path: pathlib.Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(StateDirError, match="is a symlink"):
        ensure_state_dir(link)
    assert not (tmp_path / "nowhere").exists()


def test_file_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.write_text("not a folder")
    with pytest.raises(StateDirError, match="is not a folder"):
        ensure_state_dir(path)


def test_world_writable_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(0o777)
    with pytest.raises(StateDirError) as caught:
        ensure_state_dir(path)
    assert "world-writable" in caught.value.reason
    assert caught.value.hint == f"chmod o-w {path}"


def test_a_sticky_shared_folder_gets_a_private_subfolder_never_a_chmod(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "tmp-like"
    path.mkdir()
    path.chmod(0o1777)  # what /tmp is: everyone's, by design
    with pytest.raises(StateDirError, match="world-writable") as caught:
        ensure_state_dir(path)
    hint = caught.value.hint or ""
    assert "chmod" not in hint, hint
    assert f"mkdir -m 700 {path}/gpulock-$USER" in hint, hint
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o1777  # left as it was


def test_the_real_tmp_is_never_advised_a_chmod() -> None:
    with pytest.raises(StateDirError, match="world-writable") as caught:
        ensure_state_dir(pathlib.Path("/tmp"), create=False)
    assert "chmod" not in (caught.value.hint or "")
    assert "mkdir -m 700 /tmp/gpulock-$USER" in (caught.value.hint or "")


def test_a_reader_never_creates_the_state_folder(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "typo" / "state"
    with pytest.raises(NoStateDir) as caught:
        ensure_state_dir(path, create=False, missing_hint="check --state-dir")
    assert str(caught.value) == f"state folder {path} does not exist"
    assert caught.value.hint == "check --state-dir"
    assert not (tmp_path / "typo").exists()


def test_world_writable_is_refused_even_when_shared(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(0o2777)
    with pytest.raises(StateDirError, match="world-writable"):
        ensure_state_dir(path, group=my_group())


@needs_root
def test_foreign_owner_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    os.chown(path, 12345, 12345)
    with pytest.raises(StateDirError) as caught:
        ensure_state_dir(path)
    assert "uid 12345" in caught.value.reason
    assert "not to you" in caught.value.reason


@needs_root
def test_foreign_owner_is_fine_through_the_group(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    os.chown(path, 12345, os.getgid())
    path.chmod(0o2770)
    assert ensure_state_dir(path, group=my_group()) == path


@needs_root
def test_foreign_owner_and_foreign_group_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    os.chown(path, 12345, 12345)
    path.chmod(0o2770)
    with pytest.raises(StateDirError, match="not to you"):
        ensure_state_dir(path, group=my_group())


@needs_root
def test_shared_folder_with_the_wrong_group_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    os.chown(path, os.geteuid(), 12345)
    path.chmod(0o2770)
    with pytest.raises(StateDirError) as caught:
        ensure_state_dir(path, group=my_group())
    assert "gid 12345" in caught.value.reason
    assert caught.value.hint is not None and caught.value.hint.startswith("chgrp")


def test_shared_folder_must_be_open_to_the_group(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    path.chmod(0o770)  # no set-group-id: files would get their creator's group
    with pytest.raises(StateDirError, match="needs 2770"):
        ensure_state_dir(path, group=my_group())


def test_unknown_group_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StateDirError, match="group 'no-such-group-here' does not exist"):
        ensure_state_dir(tmp_path / "state", group="no-such-group-here")
    assert not (tmp_path / "state").exists()


def test_network_filesystem_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.path.realpath(tmp_path)
    sample = tmp_path / "mountinfo"
    sample.write_text(
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        f"90 27 0:50 / {real} rw,relatime shared:7 - nfs4 server:/export rw,vers=4.2\n"
    )
    monkeypatch.setattr(state, "MOUNTINFO", str(sample))
    with pytest.raises(StateDirError) as caught:
        ensure_state_dir(tmp_path / "state")
    assert "network filesystem (nfs4)" in caught.value.reason
    assert "flock" in caught.value.reason


def test_local_filesystem_is_accepted(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sample = tmp_path / "mountinfo"
    sample.write_text("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    monkeypatch.setattr(state, "MOUNTINFO", str(sample))
    ensure_state_dir(tmp_path / "state")


def test_real_mountinfo_is_readable_here(tmp_path: pathlib.Path) -> None:
    try:
        text = pathlib.Path("/proc/self/mountinfo").read_text()
    except OSError:
        pytest.skip("no /proc/self/mountinfo")
    assert fs_type_of("/", text) is not None


# --- ensure_subdir ---------------------------------------------------------------------------


def test_subdir_created_private(tmp_path: pathlib.Path, strict_umask: None) -> None:
    root = ensure_state_dir(tmp_path / "state")
    sub = ensure_subdir(root, "gpu0")
    assert sub == root / "gpu0"
    assert mode_of(sub) == 0o700


def test_subdir_created_shared(tmp_path: pathlib.Path, strict_umask: None) -> None:
    root = ensure_state_dir(tmp_path / "state", group=my_group())
    sub = ensure_subdir(root, "residents", group=my_group())
    assert mode_of(sub) == 0o2770


def test_subdir_symlink_is_refused(tmp_path: pathlib.Path) -> None:
    root = ensure_state_dir(tmp_path / "state")
    (tmp_path / "elsewhere").mkdir()
    (root / "gpu0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StateDirError, match="is a symlink"):
        ensure_subdir(root, "gpu0")


def test_subdir_world_writable_is_refused(tmp_path: pathlib.Path) -> None:
    root = ensure_state_dir(tmp_path / "state")
    (root / "gpu1").mkdir()
    (root / "gpu1").chmod(0o777)
    with pytest.raises(StateDirError, match="world-writable"):
        ensure_subdir(root, "gpu1")


@needs_root
def test_subdir_foreign_owner_is_refused(tmp_path: pathlib.Path) -> None:
    root = ensure_state_dir(tmp_path / "state")
    (root / "gpu0").mkdir()
    os.chown(root / "gpu0", 12345, 12345)
    with pytest.raises(StateDirError, match="uid 12345"):
        ensure_subdir(root, "gpu0")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/etc"])
def test_subdir_name_must_be_plain(tmp_path: pathlib.Path, name: str) -> None:
    with pytest.raises(ValueError, match="not a plain folder name"):
        ensure_subdir(tmp_path, name)


def test_subdir_needs_its_parent(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StateDirError, match="cannot create it"):
        ensure_subdir(tmp_path / "missing", "gpu0")


# --- fs_type_of ------------------------------------------------------------------------------

MOUNTINFO_SAMPLE = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
40 27 0:40 / /home rw,relatime shared:5 master:2 - nfs4 fs:/home rw,vers=4.2
41 40 254:1 / /home/alice/scratch rw,relatime - xfs /dev/vdb rw
42 27 0:42 / /mnt/data rw - cifs //nas/data rw
43 27 0:43 / /mnt/with\\040space rw - fuse.sshfs me@host: rw
44 27 254:2 / /srv rw - ext4 /dev/vdc rw
45 44 0:45 / /srv rw - 9p hostshare rw
46 27 0:46 / /back\\134slash rw - glusterfs g:/v rw
this line is garbage
47 27 0:47 / /short rw -
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/", "ext4"),
        ("/var/lib/gpulock", "ext4"),
        ("/proc/self", "proc"),
        ("/home", "nfs4"),
        ("/home/alice/.local/state/gpulock", "nfs4"),
        ("/home/alice/scratch/state", "xfs"),  # the longest mount point wins
        ("/home/alice/scratchpad", "nfs4"),  # a prefix of the name is not a parent folder
        ("/mnt/data/x", "cifs"),
        ("/mnt/database", "ext4"),
        ("/mnt/with space/state", "fuse.sshfs"),  # \040 is a space
        ("/back\\slash", "glusterfs"),  # \134 is a backslash
        ("/srv/gpulock", "9p"),  # of two mounts on one point, the later is on top
        ("/short", "ext4"),  # a line without a type after '-' is skipped
    ],
)
def test_fs_type_of(path: str, expected: str) -> None:
    assert fs_type_of(path, MOUNTINFO_SAMPLE) == expected


def test_fs_type_of_without_any_match() -> None:
    assert fs_type_of("/x", "") is None
    assert fs_type_of("/x", "40 27 0:40 / /home rw - nfs4 fs:/home rw\n") is None


def test_network_types() -> None:
    assert {"nfs", "nfs4", "cifs", "fuse.sshfs", "9p", "lustre"} <= NETWORK_FS
    assert "ext4" not in NETWORK_FS and "tmpfs" not in NETWORK_FS


# --- atomic_write ----------------------------------------------------------------------------


def leftovers(folder: pathlib.Path) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith(".tmp-")]


def test_atomic_write_creates_and_replaces(tmp_path: pathlib.Path, strict_umask: None) -> None:
    target = tmp_path / "12.ticket"
    atomic_write(target, b"first")
    assert target.read_bytes() == b"first"
    assert mode_of(target) == 0o600
    inode = os.stat(target).st_ino
    atomic_write(target, b"second, longer than the first")
    assert target.read_bytes() == b"second, longer than the first"
    assert os.stat(target).st_ino != inode  # replaced by rename, never rewritten in place
    assert leftovers(tmp_path) == []


def test_atomic_write_mode_is_umask_proof(tmp_path: pathlib.Path, strict_umask: None) -> None:
    target = tmp_path / "shared.ticket"
    atomic_write(target, b"x", mode=0o660)
    assert mode_of(target) == 0o660


def test_atomic_write_large(tmp_path: pathlib.Path) -> None:
    data = os.urandom(3 << 20)
    atomic_write(tmp_path / "big", data)
    assert (tmp_path / "big").read_bytes() == data


def test_atomic_write_cleans_up_on_error(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "child").write_text("so rename cannot replace it")
    with pytest.raises(OSError):
        atomic_write(target, b"data")
    assert leftovers(tmp_path) == []


def test_atomic_write_replaces_a_symlink_not_its_target(tmp_path: pathlib.Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    link = tmp_path / "record"
    link.symlink_to(victim)
    atomic_write(link, b"new")
    assert victim.read_bytes() == b"keep"
    assert not link.is_symlink()
    assert link.read_bytes() == b"new"


def test_atomic_write_missing_folder(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "x", b"data")


# --- read_small ------------------------------------------------------------------------------


def test_read_small_missing_is_none(tmp_path: pathlib.Path) -> None:
    assert read_small(tmp_path / "gone") is None
    assert read_small(tmp_path / "no-folder" / "gone") is None


def test_read_small_reads(tmp_path: pathlib.Path) -> None:
    (tmp_path / "r").write_bytes(b'{"seq": 1}')
    assert read_small(tmp_path / "r") == b'{"seq": 1}'
    (tmp_path / "empty").write_bytes(b"")
    assert read_small(tmp_path / "empty") == b""


def test_read_small_refuses_a_symlink(tmp_path: pathlib.Path) -> None:
    (tmp_path / "real").write_bytes(b"secret")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(StateDirError, match="is a symlink"):
        read_small(tmp_path / "link")


def test_read_small_refuses_a_fifo_without_blocking(tmp_path: pathlib.Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StateDirError, match="not a regular file"):
        read_small(tmp_path / "fifo")


def test_read_small_refuses_a_folder(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StateDirError, match="not a regular file"):
        read_small(tmp_path)


def test_read_small_limit(tmp_path: pathlib.Path) -> None:
    (tmp_path / "r").write_bytes(b"x" * 100)
    assert read_small(tmp_path / "r", limit=100) == b"x" * 100
    with pytest.raises(StateDirError, match="larger than 99 bytes"):
        read_small(tmp_path / "r", limit=99)


# --- open_regular and read_tail: locks and logs ---------------------------------------------

OPEN_FLAGS = [
    pytest.param(os.O_RDONLY, id="read"),
    pytest.param(os.O_WRONLY | os.O_APPEND | os.O_CREAT, id="append"),
    pytest.param(os.O_RDWR | os.O_CREAT, id="lock"),
]


@pytest.mark.parametrize("flags", OPEN_FLAGS)
def test_open_regular_refuses_a_fifo_without_blocking(tmp_path: pathlib.Path, flags: int) -> None:
    # A plain open of a FIFO for reading or writing waits for the other end: for ever.
    os.mkfifo(tmp_path / "log.jsonl")
    with pytest.raises(StateDirError, match="not a regular file") as caught:
        open_regular(tmp_path / "log.jsonl", flags)
    assert caught.value.hint is not None and "mv " in caught.value.hint


@pytest.mark.parametrize("flags", OPEN_FLAGS)
def test_open_regular_refuses_a_folder(tmp_path: pathlib.Path, flags: int) -> None:
    (tmp_path / "run.lock").mkdir()
    with pytest.raises(StateDirError, match="not a regular file"):
        open_regular(tmp_path / "run.lock", flags)


@pytest.mark.parametrize("flags", OPEN_FLAGS)
def test_open_regular_never_follows_a_symlink(tmp_path: pathlib.Path, flags: int) -> None:
    outside = tmp_path / "outside"
    (tmp_path / "run.lock").symlink_to(outside)  # dangling: O_CREAT would make the target
    with pytest.raises(StateDirError, match="is a symlink"):
        open_regular(tmp_path / "run.lock", flags)
    assert not outside.exists()


def test_open_regular_gives_a_new_file_its_exact_mode_and_leaves_an_old_one(
    tmp_path: pathlib.Path, strict_umask: None
) -> None:
    fd = open_regular(tmp_path / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o660)
    assert os.get_blocking(fd)  # non-blocking only while it might have been a FIFO
    os.close(fd)
    assert mode_of(tmp_path / "ledger.lock") == 0o660  # not 0o600: the umask is 0o077
    (tmp_path / "ledger.lock").chmod(0o640)
    os.close(open_regular(tmp_path / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o660))
    assert mode_of(tmp_path / "ledger.lock") == 0o640  # another member's file keeps its mode
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "gone", os.O_RDONLY)


@pytest.mark.parametrize(
    ("limit", "tail"),
    [
        (100, b"aaaa\nbbbb\ncccc\n"),
        (15, b"aaaa\nbbbb\ncccc\n"),
        (14, b"bbbb\ncccc\n"),  # the first line cut by one byte is dropped
        (10, b"bbbb\ncccc\n"),  # the limit falls exactly after a newline: nothing is cut
        (9, b"cccc\n"),
        (4, b""),
    ],
)
def test_read_tail_gives_whole_lines(tmp_path: pathlib.Path, limit: int, tail: bytes) -> None:
    (tmp_path / "log").write_bytes(b"aaaa\nbbbb\ncccc\n")
    assert read_tail(tmp_path / "log", limit) == tail


def test_read_tail_of_nothing_a_fifo_and_a_symlink(tmp_path: pathlib.Path) -> None:
    assert read_tail(tmp_path / "gone", 10) is None
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StateDirError, match="not a regular file"):
        read_tail(tmp_path / "fifo", 10)
    (tmp_path / "real").write_bytes(b"secret\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(StateDirError, match="is a symlink"):
        read_tail(tmp_path / "link", 10)


def test_a_doorbell_rung_as_its_owner_closes_the_claim_is_no_error(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write end opened while the owner held its claim, then the owner closed it before the
    byte went in: EPIPE.  ``ring`` says the owner is gone (a grant rings its successor: an
    exception there failed a grant already made)."""
    from gpulock.core import claim

    fifo = tmp_path / "x.fifo"
    reader = claim.create(fifo, 0o600)
    late = claim.watch(fifo)
    assert late is not None
    os.close(reader)  # the owner goes between the open and the write
    monkeypatch.setattr(claim, "_watch_quietly", lambda path: late)
    assert claim.ring(fifo) is False
