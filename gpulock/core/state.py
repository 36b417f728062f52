"""The state folder through which every gpulock process coordinates; there is no daemon.

Its place is ``$GPULOCK_STATE_DIR``, else the config's ``state_dir``, else
``~/.local/state/gpulock``.  It has to be the same folder for a cron job and for an interactive
shell of the same user, so it depends only on ``$HOME`` (or the passwd entry when cron leaves
HOME unset), never on ``$XDG_RUNTIME_DIR`` or ``$XDG_STATE_HOME``, which only login sessions have.

Anyone who can write the folder can reorder or forge the queue, so before use it must be a real
folder (not a symlink), not world-writable, owned by the effective user (or, in shared mode, by
a member of the configured group with the folder's group set to it), and on a local filesystem:
the lock rests on FIFOs and ``flock``, which do not work between the clients of NFS and the like.

Private mode: folders 0700, files 0600.  Shared mode (config ``group``): folders 2770 with that
group (set-group-id, so files made inside inherit it), files 0660.
"""

from __future__ import annotations

import grp
import os
import pathlib
import pwd
import stat
from collections.abc import Mapping
from typing import Final

from gpulock.core.errors import NoStateDir, StateDirError

__all__ = [
    "ENV_STATE_DIR",
    "dir_mode",
    "ensure_state_dir",
    "ensure_subdir",
    "expand_path",
    "file_mode",
    "home_dir",
    "resolve_state_dir",
]

ENV_STATE_DIR: Final = "GPULOCK_STATE_DIR"
DEFAULT_STATE_DIR: Final = pathlib.PurePosixPath(".local/state/gpulock")  # under the home folder
# Module-level so that tests can hand in a sample file.
MOUNTINFO = "/proc/self/mountinfo"


def file_mode(group: str | None) -> int:
    """The mode of files in the state folder: 0o600, or 0o660 when shared with ``group``."""
    return 0o660 if group else 0o600


def dir_mode(group: str | None) -> int:
    """The mode of folders in the state folder: 0o700, or 0o2770 when shared with ``group``."""
    return 0o2770 if group else 0o700


# --- where -----------------------------------------------------------------------------------


def home_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """``$HOME``, else the passwd entry of the real uid (cron may leave HOME unset).

    Raises StateDirError when neither is known (a container's uid without a passwd entry).
    """
    env = os.environ if environ is None else environ
    home = env.get("HOME")
    if home:
        return pathlib.Path(home)
    try:
        return pathlib.Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        raise StateDirError(
            "~",
            f"HOME is unset and uid {os.getuid()} has no passwd entry",
            hint=f"set HOME, or set {ENV_STATE_DIR} to the state folder",
        ) from None


def expand_path(value: str, environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """Expand a leading ``~`` (through ``home_dir``) or ``~user``; relative paths stay relative."""
    if value == "~" or value.startswith("~/"):
        return home_dir(environ) / value[2:]
    return pathlib.Path(os.path.expanduser(value))


def resolve_state_dir(
    configured: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> pathlib.Path:
    """The state folder's absolute path: ``$GPULOCK_STATE_DIR``, config, then the default.

    Symlinks are not resolved: ``ensure_state_dir`` must see them to refuse them.
    """
    env = os.environ if environ is None else environ
    named = env.get(ENV_STATE_DIR)
    if named:
        path = expand_path(named, env)
    elif configured is not None:  # the config's ``state_dir``
        path = expand_path(str(configured), env)
    else:
        path = home_dir(env) / DEFAULT_STATE_DIR
    return path.absolute()


# --- making and checking folders -------------------------------------------------------------


def ensure_state_dir(
    path: pathlib.Path,
    *,
    group: str | None = None,
    create: bool = True,
    missing_hint: str | None = None,
) -> pathlib.Path:
    """Create the state folder when missing (parents too) and check it is safe; return ``path``.

    ``create=False`` (the commands that only read it: ``status``, ``history``...) never makes
    it: a missing folder raises NoStateDir with ``missing_hint``, since an empty world shown
    for a mistyped path would hide the mistake.  Raises StateDirError, with a hint, for a
    symlink, a non-folder, a world-writable folder, one of another owner (unless shared
    through ``group``), one not set up for ``group``, or one on a network filesystem.
    """
    gid = _group_id(path, group)
    if create:
        _ensure(path, group, gid, parents=True)
    else:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NoStateDir(str(path), hint=missing_hint) from None
        except OSError as exc:
            raise StateDirError(str(path), f"cannot inspect it: {exc.strerror}") from None
        _verify(path, st, group, gid)
    _check_filesystem(path)
    return path


def ensure_subdir(state: pathlib.Path, name: str, *, group: str | None = None) -> pathlib.Path:
    """Create ``state/name`` (``gpu0``, ``residents``...) like the state folder and check it.

    ``state`` must exist already (see ``ensure_state_dir``); ``name`` is one path component.
    """
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a plain folder name")
    path = state / name
    gid = _group_id(path, group)
    _ensure(path, group, gid, parents=False)
    return path


def _group_id(path: pathlib.Path, group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StateDirError(
            str(path),
            f"group {group!r} does not exist",
            hint=f"create it (groupadd {group}), or remove 'group' from the config",
        ) from None


def _ensure(path: pathlib.Path, group: str | None, gid: int | None, *, parents: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = _create(path, group, gid, parents=parents)
    except OSError as exc:
        raise StateDirError(str(path), f"cannot inspect it: {exc.strerror}") from None
    _verify(path, st, group, gid)


def _create(
    path: pathlib.Path, group: str | None, gid: int | None, *, parents: bool
) -> os.stat_result:
    where = str(path)
    mode = dir_mode(group)
    hint = f"create it by hand (mkdir -m {mode:o} {where}), or set {ENV_STATE_DIR} elsewhere"
    if parents:
        try:
            # Parents get the usual mode, like mkdir -p: only the state folder itself is private.
            os.makedirs(path.parent, exist_ok=True)
        except OSError as exc:
            raise StateDirError(
                where, f"cannot create its parent folder: {exc.strerror}", hint=hint
            ) from None
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        # Another process made it between our lstat and mkdir: check what it made, but do not
        # chmod a folder that is not ours.
        return os.lstat(path)
    except OSError as exc:
        raise StateDirError(where, f"cannot create it: {exc.strerror}", hint=hint) from None
    # mkdir's mode is masked by the umask, and the group is the creator's primary group unless
    # set: fix both through a descriptor, so a swap of the path for a symlink cannot redirect it.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    except OSError as exc:
        os.close(fd)
        try:
            os.rmdir(path)  # leave nothing half set up behind, so a retry starts clean
        except OSError:
            pass
        raise StateDirError(
            where,
            f"cannot give it to group {group!r}: {exc.strerror}"
            if gid is not None
            else f"cannot set its mode: {exc.strerror}",
            hint=f"add yourself to the group (usermod -aG {group} $USER) and log in again"
            if gid is not None
            else None,
        ) from None
    os.close(fd)
    return os.lstat(path)


def _verify(path: pathlib.Path, st: os.stat_result, group: str | None, gid: int | None) -> None:
    where = str(path)
    elsewhere = f"set {ENV_STATE_DIR} or 'state_dir' in the config to another folder"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise StateDirError(
            where,
            f"is a symlink (to {target}); refusing to follow it",
            hint=f"point {ENV_STATE_DIR} or 'state_dir' at the real folder",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(where, "is not a folder", hint=f"move it away, or {elsewhere}")
    if st.st_mode & stat.S_IWOTH:
        raise StateDirError(
            where,
            "is world-writable, so any user could tamper with the queue",
            hint=_world_writable_hint(path, st),
        )
    euid = os.geteuid()
    if st.st_uid != euid and not (gid is not None and st.st_gid == gid):
        raise StateDirError(
            where,
            f"belongs to {_user(st.st_uid)}, not to you ({_user(euid)})",
            hint=f"{elsewhere}, or share it through 'group' in the config",
        )
    if gid is not None:
        if st.st_gid != gid:
            raise StateDirError(
                where,
                f"belongs to group {_group_name(st.st_gid)}, not to {group!r} as configured",
                hint=f"chgrp {group} {where} && chmod 2770 {where}",
            )
        # Without set-group-id, files would get their creator's primary group and the other
        # members could not read them; without g+rwx they could not enter the queue at all.
        if st.st_mode & 0o2070 != 0o2070:
            raise StateDirError(
                where,
                f"is not set up to share with group {group!r} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}, needs 2770)",
                hint=f"chmod 2770 {where}",
            )


def _world_writable_hint(path: pathlib.Path, st: os.stat_result) -> str:
    """What to do about a world-writable folder: ``chmod o-w`` only for a plain folder of the
    user's own; a shared one (``/tmp``, sticky) or another's is never to be changed, so the
    advice is a private folder of one's own inside it, or elsewhere."""
    own = st.st_uid == os.geteuid()
    if own and not st.st_mode & stat.S_ISVTX and not _is_system_folder(path):
        return f"chmod o-w {path}"
    if st.st_mode & stat.S_ISVTX:  # /tmp, /var/tmp, /dev/shm: everyone's, by design
        private = path / "gpulock-$USER"
        return (
            f"it is a shared folder: leave its mode alone and use a private folder inside it "
            f"(mkdir -m 700 {private}; export {ENV_STATE_DIR}={private})"
        )
    return (
        f"leave its mode alone (not a folder of yours to change) and use a private folder of "
        f"your own (mkdir -m 700 ~/gpulock-state; export {ENV_STATE_DIR}=~/gpulock-state)"
    )


# Folders the system's own layout needs as they are, whoever owns them (root, in a container).
# Only compared with, never written to (hence the noqa: S108 is about using them).
_SYSTEM_FOLDERS: Final = frozenset(
    {"/", "/tmp", "/var/tmp", "/dev/shm", "/run", "/var", "/home", "/opt", "/srv", "/mnt"}  # noqa: S108
)


def _is_system_folder(path: pathlib.Path) -> bool:
    return (
        os.path.normpath(path) in _SYSTEM_FOLDERS
        or os.path.normpath(os.path.realpath(path)) in _SYSTEM_FOLDERS
    )


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name!r} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


# --- filesystem type -------------------------------------------------------------------------


_LOCAL_FS: set[str] = set()  # folders already found local in this process: mounts rarely move


def _check_filesystem(path: pathlib.Path) -> None:
    real = os.path.realpath(path)
    if real in _LOCAL_FS:
        return
    from gpulock.core.mounts import NETWORK_FS, fs_type_of  # only a folder being checked

    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
    except OSError:
        return  # cannot tell (no /proc): allow rather than refuse every machine without it
    fs_type = fs_type_of(real, text)
    if fs_type not in NETWORK_FS:
        _LOCAL_FS.add(real)
        return
    raise StateDirError(
        str(path),
        f"is on a network filesystem ({fs_type}); the lock relies on FIFOs and flock, "
        "which do not work between machines",
        hint=f"set {ENV_STATE_DIR} or 'state_dir' in the config to a folder on a local disk",
    )
