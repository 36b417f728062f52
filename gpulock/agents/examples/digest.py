"""``digest``: one Markdown digest of a folder of notes, a model's summary per note.

::

    gpulock agent run digest ~/notes --out ~/digest.md

Every ``*.txt`` and ``*.md`` file of the folders given (files may be named directly too) gets a
section: its title, its path and word count, and a one-paragraph summary from the router's model
for ``summarize``.  The batch is checkpointed, so a run killed half-way resumes with the notes
it had not done; the digest is written at once at the end (never half a file).  ``--out``
defaults to ``<state>/agents/digest/out/digest.md``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Final

from gpulock.agents.examples.common import (
    NOTE_SUFFIXES,
    Doc,
    Stash,
    fit,
    input_files,
    models_unloaded,
    one_line,
    out_file,
    paragraph,
    read_doc,
    run_hint,
    write_text,
)
from gpulock.agents.runtime import Context
from gpulock.agents.spec import agent

NAME: Final = "digest"
DEFAULT_OUT: Final = "digest.md"
SUMMARY_CHARS: Final = 700
PROMPT: Final = (
    "Summarise the following note in one short paragraph of plain prose.\n\n"
    "Title: {title}\n\n{text}\n\nSummary:"
)


@agent(NAME, task="summarize", schedule="*/30 * * * *", timeout="10m")
def digest(ctx: Context) -> None:
    """Summarise every note of a folder into one Markdown digest."""
    paths = input_files(
        ctx,
        suffixes=NOTE_SUFFIXES,
        what="a folder of notes (*.txt, *.md)",
        usage=run_hint(NAME, "~/notes --out ~/digest.md"),
    )
    out = out_file(ctx, DEFAULT_OUT)
    docs: list[Doc] = []
    too_big: list[Path] = []
    for p in paths:
        doc = read_doc(p)
        if doc is None:
            too_big.append(p)
            ctx.log.warning(f"left out {p}: too big for a note", extra={"file": str(p)})
        else:
            docs.append(doc)
    stash = Stash(ctx)
    sections: dict[str, dict[str, Any]] = {}
    with models_unloaded(ctx):
        for doc in ctx.batch(docs, key=lambda d: d.key):
            sections[doc.key] = section(ctx, stash, doc)
        # Notes done by an earlier run that was killed are skipped by the batch: their
        # results wait in the stash (or, lost, are computed again).
        for doc in docs:
            if doc.key not in sections:
                sections[doc.key] = section(ctx, stash, doc)
    text = render(inputs_text(ctx), docs, sections, too_big)
    write_text(out, text)
    stash.clear()
    ctx.log.info(f"wrote {out}", extra={"out": str(out), "notes": len(docs)})


def section(ctx: Context, stash: Stash, doc: Doc) -> dict[str, Any]:
    """One note's section data, from the stash when an earlier run did it."""
    found = stash.get(doc.key)
    if found is None:
        found = summarise(ctx, doc)
        stash.put(doc.key, found)  # before the batch moves on: done implies stashed
    return found


def summarise(ctx: Context, doc: Doc) -> dict[str, Any]:
    """One note's section data: the model's summary, cleaned, and who wrote it."""
    model = ctx.model()
    overhead = PROMPT.format(title=doc.title, text="")
    text = fit(doc.text, model, max_tokens=None, overhead=overhead)
    prompt = PROMPT.format(title=doc.title, text=text)
    answer = model.complete(prompt)
    summary = paragraph(str(answer), SUMMARY_CHARS, label="summary")
    if not summary:  # an empty answer still gives the reader something: the note's opening
        summary = paragraph(doc.text, 300) + " *(opening lines; the model returned nothing)*"
    return {
        "file": str(doc.path),
        "title": doc.title,
        "words": doc.word_count,
        "summary": summary,
        "tier": model.tier,
        "model": model.name,
    }


def inputs_text(ctx: Context) -> str:
    return ", ".join(str(p) for p in ctx.inputs)


def render(
    source: str, docs: list[Doc], sections: dict[str, dict[str, Any]], too_big: list[Path]
) -> str:
    total = sum(d.word_count for d in docs)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# Digest of {one_line(source, 120)}",
        "",
        f"*{len(docs)} notes, {total} words; written {stamp}.*",
        "",
    ]
    if not docs:
        lines += ["*No notes (`*.txt`, `*.md`) found.*", ""]
    for doc in docs:
        s = sections[doc.key]
        lines += [
            f"## {one_line(str(s['title']), 100) or doc.path.name}",
            "",
            f"`{doc.path.name}` · {s['words']} words · summary by {s['tier']} model `{s['model']}`",
            "",
            str(s["summary"]),
            "",
        ]
    if too_big:
        lines += ["## Left out", ""]
        lines += [f"- `{p.name}`: too big for a note" for p in too_big]
        lines.append("")
    return "\n".join(lines)
