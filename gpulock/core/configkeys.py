"""gpulock's own top-level config keys, each checked by a function of its own (pure).

A check takes the config being built (for its ``error``: file, line and key), the value as
written and the file's path (``state_dir`` is relative to it), and returns the ``Config`` field
it sets with the parsed value: ``hung_grace: 30s`` -> ``("hung_grace_s", 30.0)``.  What a key
means and its default are written in ``gpulock.core.config``; that module sorts the file's keys
and imports this one only when a file is read.  Pure but for the group lookup (``grp``) behind
``group``.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal

from gpulock.core.errors import show_value
from gpulock.core.units import gpu_size_mistake, parse_duration, parse_size

if TYPE_CHECKING:
    from gpulock.core.tenantspec import ConfigErrors

__all__ = ["CHECKS", "ON_HUNG_CHOICES", "OnHung"]

OnHung = Literal["report", "kill"]
ON_HUNG_CHOICES: Final[tuple[OnHung, ...]] = ("report", "kill")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_state_dir(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if value is None:
        return "state_dir", None
    if not isinstance(value, str) or not value.strip():
        raise base.error("state_dir", f"expected a folder path, got {show_value(value)}")
    path = pathlib.Path(os.path.expanduser(value))
    if not path.is_absolute():
        # Relative to the file, not to the current folder, which differs between cron and a shell.
        path = pathlib.Path(file).parent.absolute() / path
    return "state_dir", path


def _check_group(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if value is None:
        return "group", None
    if not isinstance(value, str) or not value.strip():
        raise base.error("group", f"expected a group name, got {show_value(value)}")
    import grp

    try:
        grp.getgrnam(value)
    except KeyError:
        raise base.error(
            "group",
            f"unknown group {value!r}",
            f"create it (groupadd {value}) and add the fleet's users to it, or remove 'group' "
            "for a private state folder",
        ) from None
    return "group", value


def _check_default_gpu(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    from gpulock.core.units import parse_gpus

    try:
        spec = parse_gpus(value)
    except ValueError:
        raise base.error(
            "default_gpu",
            f"expected a GPU index >= 0, a set such as 0,2, or any; got {show_value(value)}",
            "default_gpu: 0 (one GPU), default_gpu: any (whichever GPU is free first)",
        ) from None
    return "default_gpus", spec


def _positive_size(base: ConfigErrors, key: str, value: Any, example: str) -> int:
    if not (isinstance(value, str) or _is_number(value)):
        raise base.error(key, f"expected a size like {example}, got {show_value(value)}")
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise base.error(key, str(exc)) from None
    if size <= 0:
        raise base.error(key, f"expected a size above zero, got {show_value(value)}")
    return size


def _gpu_size(base: ConfigErrors, key: str, value: Any) -> int:
    """A simulated GPU's size: positive, and not so small that a unit was surely left out."""
    size = _positive_size(base, key, value, "24GiB")
    mistake = gpu_size_mistake(value, size)
    if mistake is not None:
        raise base.error(key, mistake[0], hint=mistake[1])
    return size


def _check_simulate(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if value is None:
        return "simulate_bytes", None
    if isinstance(value, str) and "," in value:
        parts = [part.strip() for part in value.split(",")]
        return "simulate_bytes", tuple(_gpu_size(base, "simulate", part) for part in parts)
    if isinstance(value, str) or _is_number(value):
        return "simulate_bytes", (_gpu_size(base, "simulate", value),)
    if isinstance(value, list) and value:
        sizes = tuple(
            _gpu_size(base, f"simulate[{index}]", item) for index, item in enumerate(value)
        )
        return "simulate_bytes", sizes
    raise base.error(
        "simulate",
        f"expected one size per GPU, like 24GiB, '24GiB,12GiB' or a list, got {show_value(value)}",
    )


def _check_reserve(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if not (isinstance(value, str) or _is_number(value)):
        raise base.error(
            "reserve", f"expected a size like 2GiB or a share like 10%, got {show_value(value)}"
        )
    try:
        # Any total will do to check the syntax; the real one is known only per GPU.
        parse_size(value, total_bytes=1 << 40)
    except ValueError as exc:
        raise base.error("reserve", str(exc)) from None
    return "reserve", value if isinstance(value, str | int) else parse_size(value)


def _check_on_hung(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if value not in ON_HUNG_CHOICES or not isinstance(value, str):
        choices = " or ".join(repr(choice) for choice in ON_HUNG_CHOICES)
        raise base.error("on_hung", f"expected {choices}, got {show_value(value)}")
    return "on_hung", value


def _check_hung_grace(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if not (isinstance(value, str) or _is_number(value)):
        raise base.error("hung_grace", f"expected a duration like 10s, got {show_value(value)}")
    try:
        return "hung_grace_s", parse_duration(value)
    except ValueError as exc:
        raise base.error("hung_grace", str(exc)) from None


def _check_exit_wait(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    if not (isinstance(value, str) or _is_number(value)):
        raise base.error("exit_wait", f"expected a duration like 10s, got {show_value(value)}")
    try:
        return "exit_wait_s", parse_duration(value)
    except ValueError as exc:
        raise base.error("exit_wait", str(exc)) from None


def _check_events_max_bytes(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
    return "events_max_bytes", _positive_size(base, "events_max_bytes", value, "10MiB")


def _boolean(key: str) -> Callable[[ConfigErrors, Any, str], tuple[str, Any]]:
    def check(base: ConfigErrors, value: Any, file: str) -> tuple[str, Any]:
        if not isinstance(value, bool):
            raise base.error(key, f"expected true or false, got {show_value(value)}")
        return key, value

    return check


# key -> its check: (the Config field it sets, the value parsed).
CHECKS: Final = {
    "state_dir": _check_state_dir,
    "group": _check_group,
    "default_gpu": _check_default_gpu,
    "simulate": _check_simulate,
    "reserve": _check_reserve,
    "on_hung": _check_on_hung,
    "hung_grace": _check_hung_grace,
    "exit_wait": _check_exit_wait,
    "events_max_bytes": _check_events_max_bytes,
    "exclusive_clears_tenants": _boolean("exclusive_clears_tenants"),
    "exclusive_clears_residents": _boolean("exclusive_clears_residents"),
}
