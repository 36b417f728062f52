"""``tagger``: up to five tags per document, from a model, into JSON sidecar files.

::

    gpulock agent run tagger ~/docs --out ~/docs-tags

For each ``*.txt``/``*.md`` document the router's model for ``tag`` is asked for a few topic
words.  Its answer is normalised (lower case, letters and inner hyphens, no stop words, no
duplicates, at most 5); when nothing usable is left, the document's own most frequent words are
the tags instead.  Each document gets ``<out>/<doc>.tags.json``::

    {"format": "gpulock.tags/1", "file": "/home/me/docs/plan.md", "tags": ["budget", "q3"],
     "source": "model", "tier": "gpu", "model": "qwen2.5-7b-instruct-q4_k_m"}

(``source``: ``model`` or ``words``), and ``<out>/tags.json`` maps every document's name to its
tags.  Checkpointed: a killed run resumes with the documents it had not done.  ``--out``
defaults to ``<state>/agents/tagger/out/``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Final

from gpulock.agents.examples.common import (
    NOTE_SUFFIXES,
    STOPWORDS,
    Doc,
    dedupe,
    fit,
    frequent_words,
    input_files,
    models_unloaded,
    out_folder,
    read_doc,
    run_hint,
    unique_names,
    write_json,
)
from gpulock.agents.runtime import Context
from gpulock.agents.spec import agent

NAME: Final = "tagger"
MAX_TAGS: Final = 5
ANSWER_TOKENS: Final = 32
SIDECAR_FORMAT: Final = "gpulock.tags/1"
INDEX_FORMAT: Final = "gpulock.tags-index/1"
INDEX: Final = "tags.json"
PROMPT: Final = (
    "List up to five short topic tags for this document, comma-separated, "
    "lower case.\n\n---\n{text}\n---\nTags:"
)
_TAG_RE: Final = re.compile(r"[a-z][a-z-]{1,22}[a-z]")
_VOWELS: Final = frozenset("aeiouy")


def normalise_tags(answer: str, limit: int = MAX_TAGS) -> list[str]:
    """The usable tags in a model's answer: words of 3-24 letters (inner hyphens allowed)
    with a vowel, not stop words, lower case, each once, in the answer's order."""
    found = []
    for raw in re.split(r"[^A-Za-z-]+", answer):
        word = raw.strip("-").lower()
        if (
            _TAG_RE.fullmatch(word)
            and word not in STOPWORDS
            and _VOWELS & set(word)
            and len(set(word)) > 1
        ):
            found.append(word)
    return dedupe(found)[:limit]


def tags_for(answer: str, text: str) -> tuple[list[str], str]:
    """The document's tags and where they came from: ``model``, else ``words``."""
    tags = normalise_tags(answer)
    if tags:
        return tags, "model"
    return frequent_words(text, MAX_TAGS), "words"


@agent(NAME, task="tag", schedule="0 * * * *", timeout="10m")
def tagger(ctx: Context) -> None:
    """Tag documents: up to five tags each, in <doc>.tags.json sidecars."""
    paths = input_files(
        ctx,
        suffixes=NOTE_SUFFIXES,
        what="documents to tag (a folder of *.txt, *.md, or files)",
        usage=run_hint(NAME, "~/docs --out ~/docs-tags"),
    )
    out = out_folder(ctx)
    names = unique_names(paths)
    docs = [d for d in (read_doc(p) for p in paths) if d is not None]
    index: dict[str, list[str]] = {}
    with models_unloaded(ctx):
        for doc in ctx.batch(docs, key=lambda d: d.key):
            index[doc.key] = tag(ctx, doc, sidecar(out, names[doc.path]))
        # Documents done by an earlier run that was killed have their sidecar already (a
        # lost one is made again).
        for doc in docs:
            if doc.key not in index:
                path = sidecar(out, names[doc.path])
                found = _read_tags(path)
                index[doc.key] = found if found is not None else tag(ctx, doc, path)
    write_json(
        out / INDEX,
        {"format": INDEX_FORMAT, "docs": {names[d.path]: index[d.key] for d in docs}},
    )
    ctx.log.info(f"tagged {len(docs)} documents", extra={"out": str(out)})


def tag(ctx: Context, doc: Doc, path: Path) -> list[str]:
    """Ask the model for ``doc``'s tags, write its sidecar at ``path``; return the tags."""
    model = ctx.model()
    overhead = PROMPT.format(text="")
    text = fit(doc.text, model, max_tokens=ANSWER_TOKENS, overhead=overhead)
    answer = str(model.complete(PROMPT.format(text=text), max_tokens=ANSWER_TOKENS))
    tags, source = tags_for(answer, doc.text)
    write_json(
        path,
        {
            "format": SIDECAR_FORMAT,
            "file": str(doc.path),
            "tags": tags,
            "source": source,
            "tier": model.tier,
            "model": model.name,
        },
    )
    return tags


def sidecar(folder: Path, name: str) -> Path:
    return folder / f"{name}.tags.json"


def _read_tags(path: Path) -> list[str] | None:
    """The tags of a sidecar; None when it is missing or not one."""
    try:
        record: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != SIDECAR_FORMAT:
        return None
    tags = record.get("tags")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return None
    return list(tags)
