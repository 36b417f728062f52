"""The page cache and the machine's memory, as a warming thread needs them (Linux).

* ``resident_bytes``: how much of a file range is cached, by ``mincore`` over a read-only shared
  mapping (which reads nothing), through ctypes;
* ``drop_from_cache``: evict a file (fsync, ``POSIX_FADV_DONTNEED``), for tests and benchmarks;
* ``mem_available_bytes``: ``MemAvailable`` from ``/proc/meminfo``;
* ``be_idle``: idle I/O class (``ioprio_set`` on the calling thread's own task) and nice 19;
* ``io_ticks_ms``: the milliseconds a disk has spent doing I/O (``/proc/diskstats``), whose
  growth over an interval says how busy it was.

ctypes is loaded on the first call, never at import.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

# ioprio_set(2): IOPRIO_WHO_PROCESS with a thread id sets that one task's priority.
_SYS_IOPRIO_SET: Final = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_WHO_PROCESS: Final = 1
_IOPRIO_CLASS_IDLE: Final = 3
_IOPRIO_CLASS_SHIFT: Final = 13


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes, None when unknown (not Linux, unreadable)."""
    try:
        with open(meminfo, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    parts = line.split()
                    return int(parts[1]) * 1024 if parts[1].isdigit() else None
    except OSError:
        return None
    return None


class _Libc:
    """mmap/mincore/munmap and ioprio_set through ctypes, loaded on the first use."""

    _lib: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls._lib is None:
            import ctypes

            lib = ctypes.CDLL(None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
            lib.syscall.restype = ctypes.c_long
            cls._lib = lib
        return cls._lib


_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes(fd: int, offset: int, length: int) -> int | None:
    """How many bytes of ``[offset, offset+length)`` of the file are in the page cache
    (``mincore`` over a read-only shared mapping, which reads nothing); None when unknown."""
    if length <= 0:
        return 0
    import ctypes
    import mmap

    libc = _Libc.get()
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    span = offset + length - start
    addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = (span + _PAGE - 1) // _PAGE
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(addr, span, vec) != 0:
            return None
        first = (offset - start) // _PAGE
        resident = sum(b & 1 for b in vec.raw[first:pages])
    finally:
        libc.munmap(addr, span)
    return min(resident * _PAGE, length)


def chunk_residency(fd: int, size: int, chunk: int) -> list[int] | None:
    """Resident bytes of each ``chunk``-sized piece of the file; None when unknown."""
    out: list[int] = []
    for offset in range(0, size, chunk):
        got = resident_bytes(fd, offset, min(chunk, size - offset))
        if got is None:
            return None
        out.append(got)
    return out


def drop_from_cache(path: str | os.PathLike[str]) -> None:
    """Evict a file from the page cache (fsync, then ``POSIX_FADV_DONTNEED``): for benchmarks
    and tests that need a cold file; dirty pages would stay, hence the fsync."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def io_ticks_ms(dev: int, diskstats: str = "/proc/diskstats") -> int | None:
    """Milliseconds the block device ``dev`` (a file's ``st_dev``) has spent doing I/O since
    boot (the tenth statistic of its ``/proc/diskstats`` line); None when unknown (not a
    block device: tmpfs, overlay; not Linux)."""
    want = (os.major(dev), os.minor(dev))
    try:
        with open(diskstats, "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 13 or not parts[0].isdigit() or not parts[1].isdigit():
                    continue
                if (int(parts[0]), int(parts[1])) == want:
                    return int(parts[12]) if parts[12].isdigit() else None
    except OSError:
        return None
    return None


def be_idle() -> None:
    """Idle I/O class and nice 19 for the calling thread only (best effort)."""
    tid = threading.get_native_id()
    nr = _SYS_IOPRIO_SET.get(os.uname().machine)
    if nr is not None:
        try:
            _Libc.get().syscall(
                nr, _IOPRIO_WHO_PROCESS, tid, _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT
            )
        except (OSError, AttributeError):
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError:
        pass
