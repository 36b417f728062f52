"""The one YAML config file shared by gpulock and the packages built on it.

Where it is looked for, first found wins:

1. the path given with ``--config`` (an error when it does not exist);
2. ``$GPULOCK_CONFIG`` (an error when it does not exist);
3. ``./gpulock.yaml`` in the current folder;
4. ``~/.config/gpulock/config.yaml`` (``~`` is ``$HOME``, or the passwd entry when HOME is unset;
   ``$XDG_CONFIG_HOME`` is ignored on purpose, because cron does not set it and a cron job must
   find the same file as an interactive shell);
5. ``/etc/gpulock/config.yaml``.

No file at all means every default below.  An empty file, or one holding only comments, does too.

Keys owned by gpulock (the defaults live in ``DEFAULTS``, written as they would be in the file):

``state_dir`` (path, default: ``$GPULOCK_STATE_DIR``, else ``~/.local/state/gpulock``)
    The folder through which all processes coordinate.  ``~`` is expanded; a relative path is
    relative to the config file's own folder, so cron and a shell agree.  ``$GPULOCK_STATE_DIR``
    overrides it.  It must be on a local filesystem (not NFS, CIFS, sshfs...).
``group`` (group name, default: none)
    Share the state folder between the users of this group: it is created with mode 2770 and
    the group, and files in it 0660.  Without it the folder is private (0700).  The group must
    exist.
``default_gpu`` (a GPU index, a set such as ``0,2`` or ``[0, 2]``, or ``any``; default ``0``)
    The GPU a ticket waits for when its caller names none.  ``any`` (or a set) lets each
    ticket be granted on whichever GPU of this machine (of the set) can take it first: one
    line in front of several GPUs.  What lives on one GPU (a resident model, a tenant without
    ``gpu:``) takes the first of the set.
``simulate`` (sizes, default: none)
    Pretend there are GPUs of these memory sizes instead of asking the driver, for machines
    without one and for tests: ``24GiB``, ``"24GiB,12GiB"`` or a YAML list of sizes.  Each is
    at least 64 MiB: a size without a unit counts bytes, so ``simulate: 24`` is refused
    ("did you mean 24GiB?").
``reserve`` (size or percentage, default ``10%``)
    Memory of each GPU that is never handed out (driver, CUDA context, fragmentation): a size
    such as ``2GiB`` or a share of the GPU's memory such as ``10%``.
``on_hung`` (``report`` or ``kill``, default ``report``)
    What to do with a holder whose process is alive but stopped answering: only report it, or
    kill it and hand the GPU on.
``hung_grace`` (duration, default ``10s``)
    How long a kill waits after SIGTERM before SIGKILL.
``exit_wait`` (duration, default ``10s``)
    After a holder dies (as opposed to releasing), the longest its successor waits for the
    dead holder's processes to exit and, on a real GPU, for NVML to stop listing them, so
    the memory they held is free.  ``0`` grants at once, as before.
``events_max_bytes`` (size, default ``10MiB``)
    The events log is rotated when it grows past this.
``exclusive_clears_tenants`` (boolean, default ``true``)
    Before an exclusive grant (``gpulock run`` without ``--need``), unload the idle, unpinned
    models of the tenants on that GPU.
``exclusive_clears_residents`` (boolean, default ``true``)
    Before an exclusive grant, ask the idle, unpinned library residents on that GPU (a
    ``gpulock.resident``, ``gpulock serve``'s models) to unload too, and verify the memory
    came back; in-use and pinned ones stay and are named in the grant event.
``tenants`` (list, default none)
    Model servers gpulock sees, evicts and verifies: validated by ``gpulock.core.tenantspec``
    (imported only when the section is there) into ``Config.tenants``.

Sizes read like ``6GiB``, ``800MiB``, ``2GB`` or ``512M``; durations like ``30s``, ``5m``, ``1h30m``
(see ``gpulock.core.units``).

Sections owned by the other packages (``watchdog``, ``governor``, ``routes``, ``router``,
``agents``, ``metrics``, ``serve``, ``cluster``) and by other modules (``prefetch``:
``gpulock.lock.prefetch``; ``eviction``: ``gpulock.core.foresight``; ``prewarm``:
``gpulock.core.prewarm``) are kept as read, in
``Config.sections``, and validated by their owners; ``Config.error`` lets them report a bad value
with this file's name and the value's line.
Any other top-level key is an error, so that a typo is not silently ignored.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from gpulock.core.errors import ConfigError, known_hint, show_value
from gpulock.core.units import parse_duration, parse_size

if TYPE_CHECKING:
    from gpulock.core.configkeys import OnHung
    from gpulock.core.tenantspec import TenantSpec

__all__ = [
    "DEFAULTS",
    "SECTIONS",
    "Config",
    "load_config",
    "parse_config",
    "show_value",
]

# The one place the defaults are written, in the file's own syntax; Config's field defaults are
# parsed from it below.
DEFAULTS: Final[Mapping[str, Any]] = MappingProxyType(
    {
        "state_dir": None,
        "group": None,
        "default_gpu": 0,
        "simulate": None,
        "reserve": "10%",
        "on_hung": "report",
        "hung_grace": "10s",
        "exit_wait": "10s",
        "events_max_bytes": "10MiB",
        "exclusive_clears_tenants": True,
        "exclusive_clears_residents": True,
    }
)

SECTIONS: Final[frozenset[str]] = frozenset(
    # The other packages' sections: validated by them, kept raw here with their lines.
    {"watchdog", "governor", "routes", "router", "agents", "metrics", "serve", "prefetch"}
    | {"eviction"}  # gpulock.core.foresight.policy_of
    | {"prewarm"}  # gpulock.core.prewarm.options
    | {"cluster"}  # owned by the cluster package (docs/cluster.md)
)


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Config:
    """The validated config: gpulock's own keys parsed, the other sections kept raw.

    ``path`` is None when no file was found.  ``lines`` maps dotted key paths of the whole
    document (``routes.summarize[0].model``) to 1-based line numbers.
    """

    path: pathlib.Path | None = None
    state_dir: pathlib.Path | None = DEFAULTS["state_dir"]
    group: str | None = DEFAULTS["group"]
    default_gpu: int = DEFAULTS["default_gpu"]  # one GPU: the first of the set below
    default_gpus: int | str | tuple[int, ...] = DEFAULTS["default_gpu"]  # as asked: 0, (0, 2), any
    simulate_bytes: tuple[int, ...] | None = DEFAULTS["simulate"]
    # Kept as written: a percentage can only be resolved once the GPU's memory is known.
    reserve: str | int = DEFAULTS["reserve"]
    on_hung: OnHung = DEFAULTS["on_hung"]
    hung_grace_s: float = parse_duration(DEFAULTS["hung_grace"])
    exit_wait_s: float = parse_duration(DEFAULTS["exit_wait"])
    events_max_bytes: int = parse_size(DEFAULTS["events_max_bytes"])
    exclusive_clears_tenants: bool = DEFAULTS["exclusive_clears_tenants"]
    exclusive_clears_residents: bool = DEFAULTS["exclusive_clears_residents"]
    tenants: tuple[TenantSpec, ...] = ()  # the ``tenants:`` section, validated
    sections: Mapping[str, Any] = field(default_factory=_empty)
    lines: Mapping[str, int] = field(default_factory=_empty)

    def reserve_bytes(self, total_bytes: int) -> int:
        """The reserve for a GPU of ``total_bytes``, never more than ``total_bytes`` itself."""
        try:
            reserve = parse_size(self.reserve, total_bytes=total_bytes)
        except ValueError as exc:
            raise self.error("reserve", str(exc)) from None
        return min(reserve, total_bytes)

    def section(self, name: str) -> Any:
        """The raw value of another package's section, None when the file has none."""
        return self.sections.get(name)

    def settings_of(self, name: str, keys: Sequence[str]) -> Mapping[str, Any] | None:
        """Another package's section as a mapping whose every key is one of ``keys``; None
        when the file has none.  A ConfigError (file:line:key) for anything else."""
        raw = self.sections.get(name)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise self.error(name, f"expected a mapping of settings, got {type(raw).__name__}")
        for k in raw:
            if k not in keys:
                raise self.error(f"{name}.{k}", f"unknown key {k!r}", hint=known_hint(k, keys))
        return raw

    def line_of(self, key: str) -> int | None:
        """The line of ``key`` (a dotted path), else of its nearest parent that has one."""
        while key:
            line = self.lines.get(key)
            if line is not None:
                return line
            key = _parent(key)
        return None

    def error(self, key: str, problem: str, hint: str | None = None) -> ConfigError:
        """Build (not raise) a ConfigError naming this config's file, the key's line and the key.

        For the packages that validate their own sections: ``raise config.error(
        "routes.summarize[0].model", "expected a model name, got 3")``.
        """
        file = str(self.path) if self.path is not None else None
        return ConfigError(problem, file=file, line=self.line_of(key), key=key, hint=hint)


def _parent(key: str) -> str:
    """``a.b[2]`` -> ``a.b`` -> ``a`` -> ``""``."""
    if key.endswith("]"):
        start = key.rfind("[")
        if start > 0:
            return key[:start]
    dot = key.rfind(".")
    return key[:dot] if dot > 0 else ""


# --- loading --------------------------------------------------------------------------------


def load_config(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Find (``gpulock.core.configfile.find_config``), read and validate the config; defaults
    when there is none."""
    from gpulock.core.configfile import find_config, read_config_text  # only when asked

    path = find_config(explicit, environ)
    if path is None:
        return Config()
    config = parse_config(read_config_text(path), str(path))
    if config.section("eviction") is not None:  # a typo fails every command, not the first evict
        from gpulock.core.foresight import policy_of

        policy_of(config)
    if config.section("prewarm") is not None:  # likewise, not the governor's first pass
        from gpulock.core.prewarm import options

        options(config)
    return config


# --- reading the YAML ------------------------------------------------------------------------


def parse_config(
    text: str,
    file: str,
    *,
    sections: frozenset[str] = SECTIONS,
    problems: list[ConfigError] | None = None,
) -> Config:
    """Validate config ``text``; ``file`` names it in errors and anchors a relative state_dir.

    ``sections``: the top-level keys kept raw for another reader (the fleet file passes its
    own); any other key that is not one of gpulock's is an error naming it.  With a
    ``problems`` list, a wrong top-level key or value is added to it and left at its default
    instead of raised, so that every one of them is found (``gpulock config check``); a file
    that is not YAML still raises.

    Pure but for the group lookup (``grp``) behind ``group``.
    """
    # Imported here so that a process without a config file never pays for it, nor for PyYAML.
    from gpulock.core.safeyaml import load_mapping

    found = load_mapping(text, file)
    if found is None:
        return Config(path=pathlib.Path(file))
    document, lines = found
    return _validate(document, lines, file, sections, problems)


# --- validating gpulock's keys ---------------------------------------------------------------


def _validate(
    document: dict[Any, Any],
    lines: dict[str, int],
    file: str,
    section_names: frozenset[str],
    problems: list[ConfigError] | None = None,
) -> Config:
    """``document`` (its keys' ``lines`` beside it) checked into a Config; ``problems`` as for
    ``parse_config``."""
    from gpulock.core.configkeys import CHECKS  # like the YAML reader: only a read file needs it

    base = Config(path=pathlib.Path(file), lines=MappingProxyType(lines))
    sections, values, raw_tenants = _sort_keys(document, base, file, section_names, problems)
    changes: dict[str, Any] = {"sections": MappingProxyType(sections)}
    for key, value in values.items():
        check = CHECKS[key]
        try:
            field_name, parsed = check(base, value, file)
        except ConfigError as error:
            if problems is None:
                raise
            problems.append(error)
            continue
        changes[field_name] = parsed
    if "default_gpus" in changes:  # the one GPU of things that live on one: the set's first
        spec = changes["default_gpus"]
        first = spec[0] if isinstance(spec, tuple) else 0  # "any": gpu0, which every box has
        changes["default_gpu"] = spec if isinstance(spec, int) else first
    if raw_tenants is not None:
        from gpulock.core.tenantspec import parse_tenants  # only a config with tenants pays for it

        gpu = changes.get("default_gpu", base.default_gpu)
        try:
            changes["tenants"] = parse_tenants(base, raw_tenants, gpu)
        except ConfigError as error:
            if problems is None:
                raise
            problems.append(error)
    return dataclasses.replace(base, **changes)


def _sort_keys(
    document: dict[Any, Any],
    base: Config,
    file: str,
    section_names: frozenset[str],
    problems: list[ConfigError] | None,
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The top-level keys sorted: the other sections' (kept raw), gpulock's own values and the
    raw ``tenants:`` (None when absent).  An unknown key is raised, or added to ``problems``."""
    sections: dict[str, Any] = {}
    values: dict[str, Any] = {}
    known = sorted([*DEFAULTS, *section_names, "tenants"])
    raw_tenants = None
    for key, value in document.items():
        if key == "tenants":
            raw_tenants = value
        elif isinstance(key, str) and key in section_names:
            sections[key] = value
        elif isinstance(key, str) and key in DEFAULTS:
            values[key] = value
        else:
            # The problem names the key already: pass it as an attribute, not twice in the text.
            error = ConfigError(
                f"unknown key {key!r}",
                file=file,
                line=base.line_of(str(key)),
                hint=known_hint(key, known),
            )
            error.key = str(key)
            if problems is None:
                raise error
            problems.append(error)
    return sections, values, raw_tenants
