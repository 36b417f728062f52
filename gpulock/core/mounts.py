"""Which filesystem holds a path, read from ``/proc/self/mountinfo`` text (pure).

The lock rests on FIFOs and ``flock``, which do not work between the clients of a network
filesystem, so ``gpulock.core.state`` refuses a state folder on one of ``NETWORK_FS``; this
module only parses, and the state module reads the file (``state.MOUNTINFO``) and decides.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["NETWORK_FS", "fs_type_of"]

NETWORK_FS: Final = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "lustre",
        "gpfs",
        "9p",
    }
)


def _unescape_mount(field: str) -> str:
    """Undo the kernel's octal escapes (``\\040`` for a space) in a mountinfo path field."""
    if "\\" not in field:
        return field
    out: list[str] = []
    index = 0
    while index < len(field):
        chunk = field[index + 1 : index + 4]
        if field[index] == "\\" and len(chunk) == 3 and all(c in "01234567" for c in chunk):
            out.append(chr(int(chunk, 8)))
            index += 4
        else:
            out.append(field[index])
            index += 1
    return "".join(out)


def fs_type_of(path: str | os.PathLike[str], mountinfo_text: str) -> str | None:
    """The filesystem type of the mount holding ``path``, from ``/proc/self/mountinfo`` text.

    ``path`` should have its symlinks resolved (mount points are real paths).  The longest
    mount point that contains it wins; of equal ones the last listed, which is mounted on top.
    None when no line matches.
    """
    target = os.fspath(path)
    best_len = -1
    best: str | None = None
    for line in mountinfo_text.splitlines():
        # id parent major:minor root mount-point options [optional fields...] - type source opts
        fields = line.split()
        try:
            separator = fields.index("-", 6)
        except ValueError:
            continue
        if separator + 1 >= len(fields):
            continue
        mount = _unescape_mount(fields[4])
        inside = mount == "/" or target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best_len:
            best_len = len(mount)
            best = fields[separator + 1]
    return best
