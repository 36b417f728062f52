"""Finding agents: importing the modules whose ``@agent`` decorators register them.

Looked in, in this order (each module imported once, however often it is named):

1. ``gpulock.agents.examples``, the built-in examples; optional: when it is missing or fails to
   import the runtime carries on without it, and says why only in a debug note (``--verbose``);
2. the config's ``agents: {modules: [...]}`` (a path there is relative to the config file);
3. ``$GPULOCK_AGENT_MODULES``, comma-separated;
4. ``--module MOD``, repeatable.

A module is a dotted name (``mypkg.agents``) or a path to a ``.py`` file.  One that cannot be
imported is an error naming where it was given; in the config, with the file, line and key.
An agent of the user's named like an example replaces the example (``gpulock.agents.spec``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpulock.agents.spec import AgentError, _relabel
from gpulock.core.config import Config
from gpulock.core.errors import known_hint

__all__ = ["CONFIG_KEYS", "ENV_MODULES", "EXAMPLES", "AgentModuleError", "config_modules", "load"]

ENV_MODULES: Final = "GPULOCK_AGENT_MODULES"
EXAMPLES: Final = "gpulock.agents.examples"
CONFIG_KEYS: Final = ("modules",)

_files: dict[Path, str] = {}  # agent files imported in this process -> their module name


class AgentModuleError(AgentError):
    """A module named as holding agents cannot be imported (exit 2: a bad argument)."""

    exit_code = 2

    def __init__(self, module: str, origin: str, problem: str, *, hint: str | None = None) -> None:
        self.module = module
        self.origin = origin
        self.problem = problem
        super().__init__(f"agent module {module!r} ({origin}): {problem}", hint=hint)


@dataclass(frozen=True, slots=True)
class Source:
    """One module to import and where it was named (for messages)."""

    ref: str
    origin: str  # "--module", "$GPULOCK_AGENT_MODULES", "config"
    base: Path | None = None  # a relative .py path is relative to this folder
    config_key: str | None = None  # "agents.modules[2]" for a module named in the config


def config_modules(cfg: Config) -> list[Source]:
    """The ``agents:`` section, validated: ConfigError (file:line:key) for what is wrong."""
    raw = cfg.section("agents")
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        raise cfg.error("agents", f"expected a mapping like {{modules: [...]}}, got {_kind(raw)}")
    for key in raw:
        if key not in CONFIG_KEYS:
            raise cfg.error(
                f"agents.{key}",
                f"unknown key {key!r}",
                hint=known_hint(key, CONFIG_KEYS),
            )
    modules = raw.get("modules")
    if modules is None:
        return []
    if not isinstance(modules, list):
        raise cfg.error(
            "agents.modules",
            f"expected a list of module names or .py paths, got {_kind(modules)}",
            hint="modules: [mypkg.jobs, ~/my-agents/digest.py]",
        )
    base = cfg.path.parent.absolute() if cfg.path is not None else None
    out = []
    for i, item in enumerate(modules):
        key = f"agents.modules[{i}]"
        if not isinstance(item, str) or not item.strip():
            raise cfg.error(key, f"expected a module name or a .py path, got {_kind(item)}")
        out.append(Source(item.strip(), "config", base, key))
    return out


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def env_modules(environ: Mapping[str, str] | None = None) -> list[Source]:
    env = os.environ if environ is None else environ
    text = env.get(ENV_MODULES, "")
    return [Source(p.strip(), "$" + ENV_MODULES) for p in text.split(",") if p.strip()]


def load(
    cli_modules: Sequence[str] = (),
    *,
    config: Config | None = None,
    environ: Mapping[str, str] | None = None,
    examples: bool = True,
) -> list[str]:
    """Import every module that declares agents (see the module docstring).

    Returns debug notes (why the examples were not loaded); raises AgentModuleError or
    ConfigError for a module that was named but cannot be imported.
    """
    notes = _load_examples() if examples else []
    sources = config_modules(config) if config is not None else []
    sources += env_modules(environ)
    sources += [Source(m, "--module") for m in cli_modules]
    for source in sources:
        try:
            import_source(source)
        except AgentModuleError as e:
            if config is not None and source.config_key is not None:
                raise config.error(source.config_key, e.problem, hint=e.hint) from None
            raise
    return notes


def _load_examples() -> list[str]:
    """Import ``gpulock.agents.examples`` and each of its modules; notes say what failed, and why.

    Optional: a missing or broken example must not stop the user's agents from running.
    """
    try:
        package = importlib.import_module(EXAMPLES)
    except Exception as e:
        return [f"{EXAMPLES} not loaded: {type(e).__name__}: {e}"]
    notes = []
    # Each module too, so that an example registers whether or not __init__ imports it.
    for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
        if info.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"{EXAMPLES}.{info.name}")
        except Exception as e:
            notes.append(f"{EXAMPLES}.{info.name} not loaded: {type(e).__name__}: {e}")
    return notes


def _is_path(ref: str) -> bool:
    return ref.endswith(".py") or os.sep in ref or ref.startswith("~")


def import_source(source: Source) -> str:
    """Import one module (a dotted name or a .py file); return its module name."""
    if _is_path(source.ref):
        path = Path(os.path.expanduser(source.ref))
        if not path.is_absolute():
            path = (source.base or Path.cwd()) / path
        return _import_file(Path(os.path.normpath(path.absolute())), source)
    return _import_name(source)


def _import_name(source: Source) -> str:
    name = source.ref
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise AgentModuleError(
                name,
                source.origin,
                "no such module",
                hint="give a dotted module name on sys.path, or a path to a .py file",
            ) from None
        raise _failed(name, source, e) from None
    except Exception as e:
        raise _failed(name, source, e) from None
    return name


def _failed(ref: str, source: Source, e: BaseException) -> AgentModuleError:
    shown = f"python -c 'import {ref}'" if not _is_path(ref) else f"python {ref}"
    return AgentModuleError(
        ref,
        source.origin,
        f"import failed: {type(e).__name__}: {e}",
        hint=f"{shown} shows the traceback",
    )


def _import_file(path: Path, source: Source) -> str:
    known = _files.get(path)
    if known is not None:
        return known
    if not path.is_file():
        raise AgentModuleError(source.ref, source.origin, f"no such file: {path}")
    # A name of its own, so that a file called yaml.py or json.py shadows no real module.
    digest = hashlib.sha1(str(path).encode(), usedforsecurity=False).hexdigest()[:8]
    name = f"_agents_file_{path.stem if path.stem.isidentifier() else 'module'}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AgentModuleError(source.ref, source.origin, "cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickle look it up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise _failed(str(path), source, e) from None
    _files[path] = name
    _relabel(name, str(path))  # `agent list` shows the file, not the made-up module name
    return name
