"""``report-drafter``: draft a Markdown report from a folder of notes, section by section.

::

    gpulock agent run report-drafter ~/notes/q3 --out ~/q3-report.md

The router's model for ``draft`` first proposes an outline (a ``chat`` call: section headings,
one per line); headings are cleaned, and topped up from the notes' own titles when the model
gives fewer than three.  Then each section is written by a streamed completion
(``stream=True``), piece by piece, into ``<out>.part``, which is renamed to ``<out>`` once the
report is whole: ``tail -f`` shows the draft growing, and ``<out>`` is never half a report.
The report ends with its sources.  ``--out`` defaults to
``<state>/agents/report-drafter/out/report.md``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, TextIO

from gpulock.agents.examples.common import (
    NOTE_SUFFIXES,
    Doc,
    dedupe,
    fit,
    input_files,
    models_unloaded,
    one_line,
    out_file,
    output_mode,
    read_doc,
    run_hint,
    words,
)
from gpulock.agents.runtime import Context
from gpulock.agents.spec import AgentError, agent

NAME: Final = "report-drafter"
DEFAULT_OUT: Final = "report.md"
MIN_SECTIONS: Final = 3
MAX_SECTIONS: Final = 5
OUTLINE_TOKENS: Final = 96
HEADING_CHARS: Final = 70
SYSTEM: Final = "You draft clear, factual internal reports from a person's notes."
OUTLINE_ASK: Final = (
    "Notes for a report titled '{title}':\n\n{notes}\n\n"
    "Propose 3 to 5 section headings for the report, one per line, nothing else."
)
SECTION_PROMPT: Final = (
    "Report: {title}\nSection: {heading}\n\nRelevant notes:\n{notes}\n\n"
    "Write this section in one or two short paragraphs of plain prose.\n\n{heading}:\n"
)
_LIST_MARK_RE: Final = re.compile(r"^\s*(?:[-*+•]|\d+[.)]|#+)\s*")


def headings_from(answer: str, fallback: Iterable[str]) -> list[str]:
    """Section headings from an outline answer: one per line, list marks and Markdown dropped,
    3+ letters, each once, at most 5; topped up from ``fallback`` to at least 3."""
    found = []
    for line in answer.splitlines():
        text = _LIST_MARK_RE.sub("", line)
        text = one_line(re.sub(r"[*_`#<>\[\]|]", "", text), HEADING_CHARS).strip(" :.-")
        if sum(ch.isalpha() for ch in text) >= 3:
            found.append(text)
    headings = _unique_ci(found)[:MAX_SECTIONS]
    for extra in fallback:
        if len(headings) >= MIN_SECTIONS:
            break
        headings = _unique_ci([*headings, one_line(extra, HEADING_CHARS)])
    return headings


def _unique_ci(items: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for item in items:
        if item and item.lower() not in seen:
            seen.add(item.lower())
            out.append(item)
    return out


class LineGuard:
    """Escapes, in streamed text, what would start a heading or a code fence at a line start,
    so that a model's Markdown cannot break the report's own section structure."""

    def __init__(self) -> None:
        self.at_start = True

    def feed(self, piece: str) -> str:
        out = []
        for ch in piece:
            if self.at_start and ch in "#`~":
                out.append("\\")
            out.append(ch)
            if ch == "\n":
                self.at_start = True
            elif ch not in " \t":
                self.at_start = False
        return "".join(out)


def relevant(heading: str, docs: list[Doc], n: int = 3) -> list[Doc]:
    """The ``n`` notes sharing the most words with ``heading`` (ties: the folder's order)."""
    wanted = set(words(heading))
    ranked = sorted(range(len(docs)), key=lambda i: (-len(wanted & set(words(docs[i].text))), i))
    return [docs[i] for i in ranked[:n]]


def _excerpts(docs: list[Doc], each: int) -> str:
    return "\n".join(f"- {d.title}: {one_line(d.text, each)}" for d in docs)


@agent(NAME, task="draft", schedule="30 7 * * mon-fri", timeout="15m")
def report_drafter(ctx: Context) -> None:
    """Draft a Markdown report from a folder of notes: outline, then streamed sections."""
    paths = input_files(
        ctx,
        suffixes=NOTE_SUFFIXES,
        what="a folder of notes (*.txt, *.md)",
        usage=run_hint(NAME, "~/notes/q3 --out ~/q3-report.md"),
    )
    docs = [d for d in (read_doc(p) for p in paths) if d is not None]
    if not docs:
        raise AgentError(
            f"no notes (*.txt, *.md) in {', '.join(map(str, ctx.inputs))}",
            hint="a report needs notes to draft from",
        )
    out = out_file(ctx, DEFAULT_OUT)
    title = _title(ctx)
    with models_unloaded(ctx):
        model = ctx.model()
        headings = _outline(model, title, docs)
        ctx.log.info("outline", extra={"headings": headings})
        _write(ctx, out, title, headings, docs, model)
    ctx.log.info(f"wrote {out}", extra={"out": str(out), "sections": len(headings)})


def _title(ctx: Context) -> str:
    first = ctx.inputs[0].expanduser().absolute()
    base = first.name if first.is_dir() else first.parent.name
    return "Report: " + (one_line(base.replace("_", " ").replace("-", " "), 60) or "notes")


def _outline(model: Any, title: str, docs: list[Doc]) -> list[str]:
    overhead = OUTLINE_ASK.format(title=title, notes="") + SYSTEM
    notes = fit(_excerpts(docs, 160), model, max_tokens=OUTLINE_TOKENS, overhead=overhead)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": OUTLINE_ASK.format(title=title, notes=notes)},
    ]
    answer = str(model.chat(messages, max_tokens=OUTLINE_TOKENS))
    return headings_from(answer, dedupe(d.title for d in docs))


def _write(
    ctx: Context, out: Path, title: str, headings: list[str], docs: list[Doc], model: Any
) -> None:
    part = out.with_name(out.name + ".part")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(part, flags, output_mode(out.parent))
    done = False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            stamp = time.strftime("%Y-%m-%d %H:%M")
            f.write(f"# {title}\n\n*Draft of {stamp}, from {len(docs)} notes.*\n\n")
            for heading in headings:
                f.write(f"## {heading}\n\n")
                f.flush()
                _section(model, f, title, heading, relevant(heading, docs))
                ctx.log.info(
                    f"section {heading!r}", extra={"tier": model.tier, "model": model.name}
                )
            f.write("## Sources\n\n")
            f.writelines(f"- `{d.path.name}`: {d.title} ({d.word_count} words)\n" for d in docs)
        os.replace(part, out)
        done = True
    finally:
        if not done:  # killed or failed: no stale half draft next to the report
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass


def _section(model: Any, f: TextIO, title: str, heading: str, notes: list[Doc]) -> None:
    overhead = SECTION_PROMPT.format(title=title, heading=heading, notes="") + heading
    excerpts = fit(_excerpts(notes, 600), model, max_tokens=None, overhead=overhead)
    prompt = SECTION_PROMPT.format(title=title, heading=heading, notes=excerpts)
    guard = LineGuard()
    wrote = False
    for piece in model.complete(prompt, stream=True):
        text = guard.feed(str(piece).replace("\r", ""))
        if not wrote:
            text = text.lstrip()
            if not text:
                continue
            if text.startswith(tuple("#`~>-+*=|")):
                text = "\\" + text
        f.write(text.replace("<", "&lt;"))
        f.flush()  # a reader tailing the .part file sees the section grow
        wrote = True
    f.write("\n\n" if wrote else "*(the model wrote nothing for this section)*\n\n")
