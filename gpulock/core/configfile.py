"""Where the config file is, and its text read without ever blocking on it.

The lookup order (``--config``, ``$GPULOCK_CONFIG``, ``./gpulock.yaml``, the user's, the
system's) is documented with the keys in ``gpulock.core.config``, whose ``load_config`` calls
this module only when it is asked for the config: ``import gpulock`` alone never looks.  A path
named explicitly must exist; a FIFO, a folder, a file over 16 MiB or one that is not UTF-8 is a
``ConfigError`` naming the file.
"""

from __future__ import annotations

import os
import pathlib
import stat
from collections.abc import Mapping
from typing import Final

from gpulock.core.errors import ConfigError, StateDirError
from gpulock.core.state import expand_path, home_dir
from gpulock.core.statefile import read_at_most

__all__ = ["ENV_CONFIG", "find_config", "read_config_bytes", "read_config_text"]

ENV_CONFIG: Final = "GPULOCK_CONFIG"
LOCAL_CONFIG: Final = "gpulock.yaml"
USER_CONFIG: Final = pathlib.PurePosixPath(".config/gpulock/config.yaml")  # under the home folder
# Module-level so that tests can point it elsewhere instead of writing to /etc.
SYSTEM_CONFIG = pathlib.Path("/etc/gpulock/config.yaml")


def find_config(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> pathlib.Path | None:
    """The config file to read, or None when there is none (every default applies).

    ``environ`` defaults to ``os.environ`` and ``cwd`` to the current folder.  A path given
    explicitly or through ``$GPULOCK_CONFIG`` must exist: a typo there must not silently fall
    back to another file.
    """
    env = os.environ if environ is None else environ
    if explicit:
        return _named(explicit, env, cwd, "given with --config", "check the path given to --config")
    named = env.get(ENV_CONFIG)
    if named:
        return _named(
            named,
            env,
            cwd,
            f"named by ${ENV_CONFIG}",
            f"fix ${ENV_CONFIG}, or unset it to use the usual lookup",
        )
    candidates: list[pathlib.Path] = []
    try:
        candidates.append((pathlib.Path(cwd) if cwd else pathlib.Path.cwd()) / LOCAL_CONFIG)
    except OSError:
        pass  # the current folder was deleted under us: there is no ./gpulock.yaml to read
    try:
        candidates.append(home_dir(env) / USER_CONFIG)
    except StateDirError:
        pass  # no home folder to look in (HOME unset, no passwd entry)
    candidates.append(SYSTEM_CONFIG)
    for candidate in candidates:
        # lexists: a dangling symlink or an unreadable file is found, then reported when read,
        # rather than silently skipped in favour of the next file.
        if os.path.lexists(candidate):
            return candidate
    return None


def _named(
    value: str, env: Mapping[str, str], cwd: str | None, origin: str, hint: str
) -> pathlib.Path:
    path = expand_path(value, env)
    if cwd and not path.is_absolute():
        path = pathlib.Path(cwd) / path
    if not os.path.lexists(path):
        raise ConfigError(f"no such config file ({origin})", file=str(path), hint=hint)
    if path.is_dir():
        raise ConfigError(f"is a folder, not a config file ({origin})", file=str(path), hint=hint)
    return path


def read_config_text(path: pathlib.Path) -> str:
    """The text of a config file; ConfigError naming it when it cannot be read or is not UTF-8."""
    raw = read_config_bytes(path)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "is not UTF-8 text", file=str(path), line=raw[: exc.start].count(b"\n") + 1
        ) from None


MAX_CONFIG_BYTES: Final = 16 * 1024 * 1024  # a config is a few KiB; past this it is a mistake


def read_config_bytes(path: pathlib.Path, what: str = "config file") -> bytes:
    """The bytes of a config (or fleet) file; ConfigError naming it when it cannot be read.

    Opened without blocking and refused unless it is a regular file: a FIFO with no writer
    (``--config <(...)`` gone stale, or planted) would hang ``status`` and cron jobs for ever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"cannot read it: {exc.strerror or exc}",
            file=str(path),
            hint="check the file's permissions",
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise ConfigError(
                f"is {kind}, so it cannot be read as a {what} without blocking",
                file=str(path),
                hint=f"give the path of a regular {what}",
            )
        data = read_at_most(fd, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError(f"cannot read it: {exc.strerror or exc}", file=str(path)) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"is larger than {MAX_CONFIG_BYTES} bytes", file=str(path))
    return data
