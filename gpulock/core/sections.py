"""Every section of the config checked now by the part of gpulock that reads it (``gpulock
config check``, and a line of ``gpulock status``), instead of when that part next starts.

gpulock's own keys are checked by ``gpulock.core.config``; each other section by its owner,
found through the ``gpulock.config`` entry-point group (section name -> a function that takes
the ``Config`` and raises ``ConfigError``), the way ``gpulock.commands`` finds subcommands, so
the lock's side names none of the rooms built on it.  Every wrong top-level key or value is
reported, and the first problem of each section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from gpulock.core.config import Config, parse_config
from gpulock.core.configfile import find_config, read_config_text
from gpulock.core.errors import ConfigError

GROUP: Final = "gpulock.config"

Checker = Callable[[Config], object]


@dataclass(frozen=True, slots=True)
class Checked:
    path: Path | None  # None: no config file, every default applies
    problems: list[ConfigError] = field(default_factory=list)
    sections: tuple[str, ...] = ()  # the sections the file has and that were checked


def checkers() -> dict[str, Any]:
    """Section name -> its entry point, for every installed part that reads a section."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=GROUP)}


def check_sections(
    cfg: Config, *, skip: frozenset[str] = frozenset(), found: Mapping[str, Any] | None = None
) -> tuple[list[ConfigError], tuple[str, ...]]:
    """The first problem of each section of ``cfg`` (but ``skip``), and the sections checked.

    Each section is checked alone (the config as if it had only that section), so that two
    sections one validator reads together (``watchdog`` and ``governor``) each get their own
    first problem.  A validator that cannot be loaded is a problem of its section, not a crash.
    """
    eps = checkers() if found is None else found
    problems: list[ConfigError] = []
    checked: list[str] = []
    for name in sorted(cfg.sections):
        if name in skip or name not in eps:
            continue
        checked.append(name)
        alone = dataclasses.replace(cfg, sections=MappingProxyType({name: cfg.sections[name]}))
        try:
            check: Checker = eps[name].load()
            check(alone)
        except ConfigError as e:
            problems.append(e)
        except ImportError as e:
            problems.append(cfg.error(name, f"cannot be checked here: {e}"))
    return _in_file_order(problems), tuple(checked)


def _in_file_order(problems: list[ConfigError]) -> list[ConfigError]:
    return sorted(problems, key=lambda e: (e.line or 0, e.key or ""))


def line(e: ConfigError) -> str:
    """``file:line: key: problem``, the key named even where the problem's text names it too."""
    where = f"{e.file}:{e.line}: " if e.line is not None else (f"{e.file}: " if e.file else "")
    return f"{where}{e.key}: {e.problem}" if e.key else f"{where}{e.problem}"


def check(explicit: str | None = None) -> Checked:
    """Every problem of the config that ``explicit`` (or the usual search) finds."""
    path = find_config(explicit)
    if path is None:
        return Checked(None)
    problems: list[ConfigError] = []
    try:
        cfg = parse_config(read_config_text(path), str(path), problems=problems)
    except ConfigError as e:  # unreadable, not UTF-8, not YAML: nothing more can be read
        return Checked(path, [e])
    found, sections = check_sections(cfg)
    return Checked(path, _in_file_order(problems + found), sections)
