"""``embed-index``: a bag-of-words search index of a folder of documents (no model, no GPU).

::

    gpulock agent run embed-index ~/notes --out ~/notes-index.json

Each ``*.txt``/``*.md`` document becomes a sparse word-count vector (lower-case words of 3+
letters, stop words left out); the index holds every document's vector, each word's document
frequency and each document's most distinctive words (by tf-idf)::

    {"format": "gpulock.bow-index/1", "created_wall": 1763683200.5,
     "docs": [{"file": "/home/me/notes/a.md", "title": "...", "words": 120,
               "top": ["budget", "vendor"], "counts": {"budget": 4, ...}}, ...],
     "df": {"budget": 2, ...}}

The cheap agent of the examples: it runs on the CPU in milliseconds, next to the ones that wait
for models.  Checkpointed like the others; the index is written at once at the end.
``--out`` defaults to ``<state>/agents/embed-index/out/index.json``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Final

from gpulock.agents.examples.common import (
    NOTE_SUFFIXES,
    STOPWORDS,
    Doc,
    Stash,
    input_files,
    out_file,
    read_doc,
    run_hint,
    words,
    write_json,
)
from gpulock.agents.runtime import Context
from gpulock.agents.spec import agent

NAME: Final = "embed-index"
FORMAT: Final = "gpulock.bow-index/1"
DEFAULT_OUT: Final = "index.json"
TOP_WORDS: Final = 5


def counts_of(text: str) -> dict[str, int]:
    """The document's vector: counts of its words of 3+ letters that are not stop words."""
    c = Counter(w for w in words(text) if len(w) >= 3 and w not in STOPWORDS and "'" not in w)
    return dict(sorted(c.items()))


def top_words(counts: dict[str, int], df: dict[str, int], n_docs: int, n: int) -> list[str]:
    """The ``n`` words with the highest tf-idf in one document (ties alphabetically)."""

    def score(w: str) -> float:
        return counts[w] * math.log((1 + n_docs) / (1 + df[w]) + 1)

    return sorted(counts, key=lambda w: (-score(w), w))[:n]


@agent(NAME, schedule="15 * * * *", timeout="5m")
def embed_index(ctx: Context) -> None:
    """Build a bag-of-words search index (JSON) of a folder of documents."""
    paths = input_files(
        ctx,
        suffixes=NOTE_SUFFIXES,
        what="a folder of documents (*.txt, *.md)",
        usage=run_hint(NAME, "~/notes --out ~/notes-index.json"),
    )
    out = out_file(ctx, DEFAULT_OUT)
    docs = [d for d in (read_doc(p) for p in paths) if d is not None]
    stash = Stash(ctx)
    vectors: dict[str, dict[str, Any]] = {}
    for doc in ctx.batch(docs, key=lambda d: d.key):
        vectors[doc.key] = _vector(stash, doc)
    for doc in docs:  # done by a run that was killed: in the stash
        if doc.key not in vectors:
            vectors[doc.key] = _vector(stash, doc)
    df: Counter[str] = Counter()
    for v in vectors.values():
        df.update(v["counts"].keys())
    entries = []
    for doc in docs:
        counts = vectors[doc.key]["counts"]
        entries.append(
            {
                "file": str(doc.path),
                "title": doc.title,
                "words": doc.word_count,
                "top": top_words(counts, df, len(docs), TOP_WORDS),
                "counts": counts,
            }
        )
    write_json(
        out,
        {
            "format": FORMAT,
            "created_wall": round(time.time(), 6),
            "docs": entries,
            "df": dict(sorted(df.items())),
        },
    )
    stash.clear()
    ctx.log.info(f"indexed {len(docs)} documents", extra={"out": str(out), "words": len(df)})


def _vector(stash: Stash, doc: Doc) -> dict[str, Any]:
    found = stash.get(doc.key)
    if found is None or not isinstance(found.get("counts"), dict):
        found = {"counts": counts_of(doc.text)}
        stash.put(doc.key, found)
    return found
