"""Write the generated reference pages of the docs site from the code they describe.

- ``docs/reference/cli.md``: every ``gpulock`` command, from its argparse parser (the built-in
  commands of ``gpulock/cli.py`` and each ``gpulock.commands`` entry point of pyproject.toml,
  through the ``build_parser`` beside its ``main``);
- ``docs/reference/configuration.md``: every key of the config file, from the schema
  (``gpulock.core.config``: its documented keys, ``DEFAULTS`` and ``SECTIONS``, and the known
  keys and example of each section's owner module).

Run it after changing a command's flags or a config key::

    make reference          # or: .venv/bin/python docs/gen_reference.py

``tests/test_docs.py`` fails when the committed pages differ from a fresh generation, so the
reference cannot drift from the code.  The output depends only on the code (no terminal width,
no clock, no installed metadata).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import textwrap
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference"
WIDTH = 100  # usage lines are wrapped at this width, whatever the terminal
HEADER = (
    "<!-- Generated from the code by docs/gen_reference.py: do not edit, run `make reference`. -->\n"
)

# Where each command is explained in prose (relative to docs/reference/).  A command missing
# here is still documented, just without the link.
GUIDES: Mapping[str, str] = {
    "run": "../lock.md",
    "status": "../lock.md",
    "break": "../lock.md",
    "history": "../lock.md",
    "heartbeat": "../lock.md",
    "evict": "../residents.md",
    "tenants": "../tenants.md",
    "governor": "../governor.md",
    "metrics": "../metrics.md",
    "route": "../router.md",
    "agent": "../agents.md",
    "fleet": "../agents.md",
    "report": "../report.md",
    "serve": "../serve.md",
}


# --- the CLI ---------------------------------------------------------------------------------


def _plugins() -> dict[str, str]:
    """``gpulock.commands`` entry points as pyproject.toml declares them (name -> target)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group: dict[str, str] = project["project"]["entry-points"]["gpulock.commands"]
    return dict(group)


def _plugin_parser(target: str) -> argparse.ArgumentParser | None:
    """The parser of a ``module:main`` entry point: ``build_parser`` in ``main``'s module."""
    module_name, _, attr = target.partition(":")
    main = getattr(importlib.import_module(module_name), attr)
    build: Callable[[], argparse.ArgumentParser] | None = getattr(
        sys.modules[main.__module__], "build_parser", None
    )
    return build() if build is not None else None


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    base = parser.formatter_class
    parser.formatter_class = functools.partial(base, width=WIDTH)  # type: ignore[assignment]


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, Any]]:
    """(name, one-line help, parser) of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _md(text: str) -> str:
    """Plain text as Markdown that shows it as written."""
    text = text.replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*")
    return text.replace("|", "\\|").replace("_", "\\_").replace("`", "\\`")


def _paragraphs(text: str | None, raw: bool) -> str:
    if not text:
        return ""
    if raw:  # RawDescriptionHelpFormatter: the author's line breaks are meant
        return "  \n".join(_md(line.strip()) for line in text.strip().splitlines()) + "\n"
    return _md(" ".join(text.split())) + "\n"


def _option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    fmt = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(
            action, argparse._HelpAction | argparse._SubParsersAction
        ):
            continue
        invocation = fmt._format_action_invocation(action)
        text = fmt._expand_help(action) if action.help else ""
        rows.append((invocation, " ".join(text.split())))
    return rows


def _command(path: str, summary: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    _fixed_width(parser)
    raw = parser.formatter_class.func is not argparse.HelpFormatter  # type: ignore[attr-defined]
    out = [f"{'#' * level} `{path}`", ""]
    if summary:
        out += [_md(summary[0].upper() + summary[1:]) + ".", ""]
    usage = parser.format_usage().strip()
    out += ["```text", usage, "```", ""]
    if parser.description:
        out += [_paragraphs(parser.description, raw)]
    rows = _option_rows(parser)
    if rows:
        out += ["| argument | meaning |", "| --- | --- |"]
        out += [f"| `{_md_code(a)}` | {_md(b)} |" for a, b in rows]
        out.append("")
    if parser.epilog:
        out += [_paragraphs(parser.epilog, raw)]
    name = path.split()[1]
    if level == 2 and name in GUIDES:
        out += [f"Explained in [{_title(GUIDES[name])}]({GUIDES[name]}).", ""]
    for sub_name, sub_help, sub in _subcommands(parser):
        out += _command(f"{path} {sub_name}", sub_help, sub, level + 1)
    return out


def _md_code(text: str) -> str:
    return text.replace("|", "\\|")


def _title(page: str) -> str:
    return PAGE_TITLES.get(page.rsplit("/", 1)[-1], page)


PAGE_TITLES: Mapping[str, str] = {
    "lock.md": "The line",
    "residents.md": "Residents and eviction",
    "tenants.md": "Tenants",
    "governor.md": "Governor and watchdog",
    "metrics.md": "Metrics",
    "router.md": "Router",
    "agents.md": "Agents and fleets",
    "report.md": "The report",
    "serve.md": "Serve: the HTTP API",
    "prefetch.md": "Cold starts",
}


def cli_reference() -> str:
    from gpulock import cli

    top = cli.build_parser()
    commands: list[tuple[str, str, argparse.ArgumentParser | None]] = [
        (name, summary, sub) for name, summary, sub in _subcommands(top) if name != "help"
    ]
    for name, target in sorted(_plugins().items()):
        parser = _plugin_parser(target)
        commands.append((name, _first_sentence(parser.description if parser else None), parser))
    out = [
        HEADER,
        "# CLI reference",
        "",
        "Every command below takes `--help`. Errors are one `error:` line (and a `hint:`), or",
        "with `--json` one JSON object on stdout; the exit codes are in",
        "[Exit codes](../exit-codes.md).",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for name, summary, _ in commands:
        out.append(f"| [`gpulock {name}`](#gpulock-{name}) | {_md(_short(summary))} |")
    out += ["", "`gpulock help` lists them all, including those of installed packages.", ""]
    out += ["```text", _usage_of(top), "```", ""]
    builtin = {name for name, _, _ in _subcommands(top)}
    for name, summary, parser in commands:
        if parser is None:
            out += [f"## `gpulock {name}`", "", _md(summary), "", f"See `gpulock {name} --help`.", ""]
            continue
        # A plugin's first sentence is its description's: say it once.
        out += _command(f"gpulock {name}", summary if name in builtin else "", parser, 2)
    return "\n".join(_tidy(out))


def _first_sentence(text: str | None) -> str:
    words = " ".join((text or "").split())
    m = re.match(r"(.+?[.!?])(\s|$)", words)
    return (m.group(1) if m else words).rstrip(".")


def _short(summary: str) -> str:
    """A long summary up to its first colon, semicolon or bracket."""
    if len(summary) <= 80:
        return summary
    cuts = [i for i in (summary.find(c, 20) for c in (":", ";", " (")) if i > 0]
    return summary[: min(cuts)] if cuts else summary


def _usage_of(parser: argparse.ArgumentParser) -> str:
    _fixed_width(parser)
    return parser.format_usage().strip()


def _tidy(lines: Sequence[str]) -> list[str]:
    """No trailing spaces (except Markdown's two-space breaks), no runs of blank lines."""
    out: list[str] = []
    for line in "\n".join(lines).split("\n"):
        line = line if line.endswith("  ") and line.strip() else line.rstrip()
        if line == "" and out and out[-1] == "":
            continue
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    return [*out, ""]


# --- the config file -----------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    names: tuple[str, ...]  # the top-level keys it covers
    module: str  # the module that validates them
    keys: Mapping[str, str]  # section -> the attribute holding its known keys
    guide: str  # the docs page explaining it (relative to docs/reference/)
    defaults: str | None = None  # an attribute mapping key -> default, when the module has one


SECTIONS: tuple[Section, ...] = (
    Section(("tenants",), "gpulock.core.tenantspec", {"tenants": "KEYS"}, "../tenants.md"),
    Section(
        ("watchdog", "governor"),
        "governor.config",
        {"watchdog": "WATCHDOG_KEYS", "governor": "GOVERNOR_KEYS"},
        "../governor.md",
    ),
    Section(
        ("router", "routes"),
        "router.routes",
        {"router": "ROUTER_KEYS", "routes": "TASK_KEYS"},
        "../router.md",
        defaults="DEFAULTS",
    ),
    Section(("serve",), "serve.config", {"serve": "KEYS"}, "../serve.md"),
    Section(
        ("prefetch",), "gpulock.lock.prefetch", {"prefetch": "DEFAULTS"}, "../prefetch.md", "DEFAULTS"
    ),
    Section(("metrics",), "gpulock.metrics.config", {"metrics": "KEYS"}, "../metrics.md"),
    Section(("agents",), "agents.registry", {"agents": "CONFIG_KEYS"}, "../agents.md"),
)

_ENTRY = re.compile(r"^``(\w+)`` \((.*)\)$")


def documented_keys(doc: str) -> dict[str, tuple[str, str]]:
    """``key`` -> (type and default, meaning), from gpulock.core.config's docstring entries::

    ``key`` (type, default: ...)
        What it means.
    """
    found: dict[str, tuple[str, str]] = {}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = _ENTRY.match(line)
        if m is None:
            continue
        body = []
        for nxt in lines[i + 1 :]:
            if not nxt.startswith("    "):
                break
            body.append(nxt.strip())
        found[m.group(1)] = (m.group(2), " ".join(body))
    return found


def _yaml_examples(doc: str) -> list[str]:
    """The literal blocks (after a ``::`` line) of a module docstring, dedented."""
    blocks = []
    parts = re.split(r"(?m)^::\n\n", doc)
    for part in parts[1:]:
        block = []
        for line in part.splitlines():
            if line and not line.startswith("    "):
                break
            block.append(line)
        blocks.append(textwrap.dedent("\n".join(block)).strip("\n"))
    return blocks


def _rst(text: str) -> str:
    """reStructuredText's ``literal`` as Markdown's `literal`."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def config_reference() -> str:
    from gpulock.core import config

    doc = config.__doc__ or ""
    entries = documented_keys(doc)
    own = set(config.DEFAULTS) | {"tenants"}
    if set(entries) != own:
        missing = sorted(own - set(entries))
        extra = sorted(set(entries) - own)
        raise SystemExit(
            "gpulock/core/config.py's docstring and DEFAULTS disagree: "
            f"undocumented {missing}, documented but unknown {extra}"
        )
    lookup = doc.split("Where it is looked for, first found wins:", 1)[1].split("\n\n")[1]
    out = [
        HEADER,
        "# Configuration reference",
        "",
        "One YAML file, shared by every command and package. Where it is looked for, first",
        "found wins:",
        "",
        _rst(lookup),
        "",
        "No file at all means every default below. Mistakes are reported with the file, the line",
        "and the key; any top-level key not listed here is refused. Sizes read like `6GiB`,",
        "`800MiB`, `2GB` or `512M`; durations like `30s`, `5m`, `1h30m`. The",
        "[configuration guide](../configuration.md) has a sample file and the environment",
        "variables.",
        "",
        "## Top-level keys",
        "",
        "| key | type and default | meaning |",
        "| --- | --- | --- |",
    ]
    for key, (kind, meaning) in entries.items():
        out.append(f"| `{key}` | {_rst(kind)} | {_rst(meaning).replace('|', chr(92) + '|')} |")
    out += ["", "## Sections", ""]
    out += ["| section | validated by | explained in |", "| --- | --- | --- |"]
    covered = {name: s for s in SECTIONS for name in s.names}
    for name in sorted(set(config.SECTIONS) | {"tenants"}):
        s = covered.get(name)
        if s is None:
            out.append(f"| `{name}:` | its owner | |")
        else:
            out.append(f"| [`{name}:`](#{name}) | `{s.module}` | [{_title(s.guide)}]({s.guide}) |")
    out.append("")
    for s in SECTIONS:
        module = importlib.import_module(s.module)
        for name in s.names:
            keys = list(getattr(module, s.keys[name]))
            defaults: Mapping[str, Any] = getattr(module, s.defaults) if s.defaults else {}
            out += [f"### `{name}:`", ""]
            if name == "routes":
                out += [
                    "Each task maps to its candidates, best first: a list, or a mapping with",
                    "`candidates:` and/or `inherit: OTHER` plus candidate keys that apply to all",
                    "its candidates.",
                    "",
                ]
            if any(key in defaults for key in keys):
                out += ["| key | default |", "| --- | --- |"]
                for key in keys:
                    shown = _default(defaults[key]) if key in defaults else ""
                    out.append(f"| `{key}` | {shown} |")
                out.append("")
            else:
                out += ["Keys: " + ", ".join(f"`{key}`" for key in keys) + ".", ""]
            out += [f"Explained in [{_title(s.guide)}]({s.guide}).", ""]
        for block in _yaml_examples(module.__doc__ or ""):
            out += [f"Example (from `{s.module}`):", "", "```yaml", block, "```", ""]
    out += _fleet_file()
    return "\n".join(_tidy(out))


def _fleet_file() -> list[str]:
    from agents import fleetfile

    out = [
        "## The fleet file",
        "",
        "`gpulock fleet FILE` reads a YAML file of its own (validated by `agents.fleetfile`):",
        "",
        "| section | keys |",
        "| --- | --- |",
        "| `fleet:` | " + ", ".join(f"`{k}`" for k in fleetfile.FLEET_KEYS) + " |",
        "| `agents:` (a list) | " + ", ".join(f"`{k}`" for k in fleetfile.AGENT_KEYS) + " |",
        "",
    ]
    for block in _yaml_examples(fleetfile.__doc__ or ""):
        out += ["```yaml", block, "```", ""]
    out += ["Explained in [Agents and fleets](../agents.md).", ""]
    return out


# --- writing ---------------------------------------------------------------------------------


def pages() -> dict[Path, str]:
    """Each generated page's path and text."""
    return {OUT / "cli.md": cli_reference(), OUT / "configuration.md": config_reference()}


def main(argv: Sequence[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = []
    for path, text in pages().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"out of date: {names}; run: make reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
