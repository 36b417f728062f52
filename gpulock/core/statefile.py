"""One file of the state folder, written atomically and read without trusting what is there.

Anyone who may write the folder (a group member, a crashed writer) can leave a symlink, a FIFO,
a folder or a huge file where a record or lock should be.  So every record is replaced whole
(``atomic_write``: readers see the old content or the new, never half), read within a size
limit (``read_small``, ``read_record``, ``read_tail``), and every lock or log file is opened
without following a symlink or blocking on a FIFO (``open_regular``); the ``flock``-held forms
(``open_locked``, ``take_instance_lock``) build on it.  A refusal is a ``StateDirError`` naming
the file.  The folder itself (where it is, who may use it) is ``gpulock.core.state``'s.
"""

from __future__ import annotations

import errno
import os
import pathlib
import stat
from typing import Final

from gpulock.core.errors import StateDirError

__all__ = [
    "atomic_write",
    "open_locked",
    "open_regular",
    "read_record",
    "read_small",
    "read_tail",
    "take_instance_lock",
]

_TMP_PREFIX: Final = ".tmp-"


def atomic_write(path: pathlib.Path, data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` at once: readers see the old content or the new, never half.

    The temporary file ``.tmp-<pid>-<random>`` sits in the same folder (os.replace cannot cross
    filesystems) and is removed again on any error; the pid lets a sweeper tell stale ones.
    """
    # No fsync: these records describe live processes and mean nothing after a reboot, so
    # durability would cost milliseconds per handoff and buy nothing.
    folder = path.parent
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = folder / f"{_TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            continue  # 48 random bits collided, or a planted file: pick another name
        break
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(folder))
    try:
        try:
            os.fchmod(fd, mode)  # the umask masked open's mode
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_small(path: pathlib.Path, limit: int = 1 << 20) -> bytes | None:
    """Read a small record that may vanish at any moment; None when it does not exist.

    Refuses (StateDirError) a symlink, anything but a regular file (a FIFO would block a plain
    open, so it is opened non-blocking and then refused) and a file over ``limit`` bytes, rather
    than returning a truncated record.  Other OS errors (permissions) propagate.
    """
    found = read_record(path, limit)
    return None if found is None else found[0]


def read_record(path: pathlib.Path, limit: int = 1 << 20) -> tuple[bytes, os.stat_result] | None:
    """``read_small``, with the file's status as opened: its ``st_uid`` is who wrote it.

    In a group-shared folder any member can write a record that claims to be another's;
    the owner of the file is the one thing a writer cannot forge.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateDirError(str(path), "is not a regular file; refusing to read it")
        data = read_at_most(fd, limit)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise StateDirError(str(path), f"is larger than {limit} bytes; refusing to read it")
    return data, st


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` + 1 bytes of ``fd``: one byte more tells "exactly limit" from "too large"
    (the caller refuses a longer file by its length, without reading all of it)."""
    chunks: list[bytes] = []
    remaining = limit + 1
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def open_regular(path: pathlib.Path, flags: int, mode: int = 0o600) -> int:
    """Open a lock or log file of the state folder with ``os.open`` ``flags``; return the fd.

    Never through a symlink, and never stuck on a FIFO put in the file's place (the open is
    non-blocking until the file is known to be a regular one): either is refused with a
    StateDirError, as is a folder or any other non-regular file.  With ``O_CREAT``, a file this
    call makes gets exactly ``mode``: the umask would turn a shared 0o660 into 0o640, and the
    group's other members could then not open the lock.  An existing file keeps its mode (it
    may be another member's).  Other OS errors (permissions, a missing folder) propagate.
    """
    base = (flags & ~os.O_CREAT) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        created = False
        fd = -1
        for _ in range(8):  # created, or opened as it was: retried only while both race away
            if flags & os.O_CREAT:
                try:
                    fd = os.open(path, base | os.O_CREAT | os.O_EXCL, mode)
                    created = True
                    break
                except FileExistsError:
                    pass
            try:
                fd = os.open(path, base)
                break
            except FileNotFoundError:
                if not flags & os.O_CREAT:
                    raise
        else:
            raise FileNotFoundError(errno.ENOENT, "created and removed again", str(path))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink(path) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # a folder; a FIFO with no reader
            raise _not_regular(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path)
        if created:
            os.fchmod(fd, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _symlink(path: pathlib.Path) -> StateDirError:
    return StateDirError(
        str(path),
        "is a symlink; refusing to follow it",
        hint="remove it: gpulock never puts symlinks in its state folder",
    )


def _not_regular(path: pathlib.Path) -> StateDirError:
    return StateDirError(
        str(path),
        "is not a regular file; refusing to use it",
        hint=f"move it away (mv {path} {path}.bad): gpulock makes a new one",
    )


def open_locked(path: pathlib.Path, mode: int, *, wait: bool = False) -> int | None:
    """``path`` opened read-write (``open_regular``, created with ``mode``) and held with an
    exclusive ``flock``; None when another process holds it, unless ``wait``: then block until
    it is ours.  The kernel drops the lock when the descriptor is closed or its process dies.
    """
    import fcntl

    fd = open_regular(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def take_instance_lock(path: pathlib.Path, mode: int, record: bytes, *, what: str) -> int | None:
    """Be the one process of a kind (a governor, a fleet, an agent's run): hold ``path`` with a
    non-blocking ``flock`` and write ``record`` (who we are) in it.

    Returns the descriptor to keep open for as long as we are that process (closing it, or
    exiting, lets the next one in), or None when another process holds it: its record can be
    read with ``read_small``.  StateDirError when ``what`` cannot be opened, or ``path`` is a
    symlink, a folder or a FIFO (``open_regular``).
    """
    try:
        fd = open_locked(path, mode)
    except StateDirError:
        raise
    except OSError as e:
        raise StateDirError(
            str(path),
            f"cannot open {what}: {e.strerror or e}",
            hint=f"check the owner and mode of {path.parent} (ls -la)",
        ) from None
    if fd is None:
        return None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
    except OSError:
        pass  # the lock is what counts; the record only names us in others' messages
    return fd


def read_tail(path: pathlib.Path, limit: int) -> bytes | None:
    """The whole lines among the last ``limit`` bytes of a log; None when it does not exist.

    When the file is longer, the line cut by the limit is dropped.  Refuses a symlink or a
    non-regular file (StateDirError) as ``open_regular`` does; other OS errors propagate.
    """
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # From one byte before the limit: when that byte ends a line, no line was cut.
        cut_at = os.fstat(fd).st_size - limit
        start = max(0, cut_at - 1)
        chunks: list[bytes] = []
        offset, remaining = start, limit + (cut_at > 0)
        while remaining > 0:
            chunk = os.pread(fd, min(remaining, 1 << 16), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if cut_at > 0:
        cut = data.find(b"\n")
        data = b"" if cut < 0 else data[cut + 1 :]
    return data
