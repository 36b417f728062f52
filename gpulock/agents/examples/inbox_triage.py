"""``inbox-triage``: sort an inbox folder into label folders, a model choosing each label.

::

    gpulock agent run inbox-triage ~/inbox --out ~/inbox-sorted

For each message file of the inbox (any regular, non-hidden file) the router's model for
``classify`` is asked for one of ``work, personal, billing, newsletter, spam``; the first of
those words in its answer is the label (none: ``unsorted``).  The message is copied to
``<out>/<label>/`` and a record appended to ``<out>/triage.jsonl``::

    {"file": "/home/me/inbox/0042.txt", "name": "0042.txt", "label": "billing",
     "tier": "cpu", "model": "qwen2.5-0.5b-instruct-q8_0", "answer": "billing",
     "sha256": "...", "ts": 1763683200.5}

Messages already in ``triage.jsonl`` (same name and content) are not asked about again, so a
cron run only costs model calls for new mail; one edited since is triaged again (and moved if
its label changed).  The inbox itself is left as it is.  ``--out`` defaults to
``<state>/agents/inbox-triage/out/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Final

from gpulock.agents.examples.common import (
    fit,
    input_files,
    models_unloaded,
    one_line,
    out_folder,
    output_mode,
    read_doc,
    run_hint,
    unique_names,
    write_bytes,
)
from gpulock.agents.runtime import Context
from gpulock.agents.spec import agent

NAME: Final = "inbox-triage"
LABELS: Final = ("work", "personal", "billing", "newsletter", "spam")
UNSORTED: Final = "unsorted"
RECORDS: Final = "triage.jsonl"
ANSWER_TOKENS: Final = 8  # a label is one word; a longer answer is not needed to find it
PROMPT: Final = (
    "Classify this email as exactly one of: {labels}.\n"
    "Reply with the label only.\n\n---\n{message}\n---\nLabel:"
)
_LABEL_RE: Final = re.compile(r"\b(" + "|".join(LABELS) + r")\b", re.IGNORECASE)


def label_of(answer: str) -> str:
    """The first label word in ``answer`` (any case), else ``unsorted``."""
    m = _LABEL_RE.search(answer)
    return m.group(1).lower() if m else UNSORTED


@agent(NAME, task="classify", schedule="*/10 * * * *", timeout="5m")
def inbox_triage(ctx: Context) -> None:
    """Sort inbox messages into label folders (work, personal, billing, newsletter, spam)."""
    paths = input_files(
        ctx,
        suffixes=None,
        what="an inbox folder of message files",
        usage=run_hint(NAME, "~/inbox --out ~/inbox-sorted"),
    )
    out = out_folder(ctx)
    records_path = out / RECORDS
    known = _known(records_path)
    names = unique_names(paths)
    todo = []
    for p in paths:
        with p.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if (names[p], digest) in known:
            continue
        todo.append((p, digest))
    ctx.log.info(
        f"{len(todo)} new of {len(paths)} messages", extra={"new": len(todo), "total": len(paths)}
    )
    counts: dict[str, int] = {}
    with models_unloaded(ctx):
        for p, digest in ctx.batch(todo, key=lambda item: f"{item[0]}|{item[1]}"):
            label, answer, model = _classify(ctx, p)
            _file(p, out, label, names[p])
            # After the copy: a record means the message is in its folder.
            _append(
                records_path,
                {
                    "file": str(p),
                    "name": names[p],
                    "label": label,
                    "tier": model.tier,
                    "model": model.name,
                    "answer": answer,
                    "sha256": digest,
                    "ts": round(time.time(), 6),
                },
            )
            counts[label] = counts.get(label, 0) + 1
    ctx.log.info(f"triaged {len(todo)} messages", extra={"labels": counts, "out": str(out)})


def _classify(ctx: Context, path: Path) -> tuple[str, str, Any]:
    model = ctx.model()
    doc = read_doc(path)
    if doc is not None:
        text = doc.text
    else:  # too big to be mail: its start is enough to classify it
        with path.open("rb") as f:
            text = f.read(8192).decode(errors="replace")
    overhead = PROMPT.format(labels=", ".join(LABELS), message="")
    message = fit(text, model, max_tokens=ANSWER_TOKENS, overhead=overhead)
    prompt = PROMPT.format(labels=", ".join(LABELS), message=message)
    answer = str(model.complete(prompt, max_tokens=ANSWER_TOKENS))
    return label_of(answer), one_line(answer, 80), model


def _known(path: Path) -> set[tuple[str, str]]:
    """(name, content hash) of the messages triaged already; lines that do not parse are
    skipped.  A message renamed or edited since counts as new."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return set()
    out = set()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            name, digest = record.get("name"), record.get("sha256")
            if isinstance(name, str) and isinstance(digest, str):
                out.add((name, digest))
    return out


def _file(src: Path, out: Path, label: str, name: str) -> None:
    """Copy ``src`` to ``out/label/name``; a copy under another label (the message was
    edited and triaged again) is removed: one message, one folder."""
    folder = out / label
    folder.mkdir(exist_ok=True)
    write_bytes(folder / name, src.read_bytes())
    for other in (*LABELS, UNSORTED):
        if other != label:
            try:
                (out / other / name).unlink()
            except FileNotFoundError:
                pass


def _append(path: Path, record: dict[str, Any]) -> None:
    """One line, one ``write()`` on ``O_APPEND``: a kill never leaves half a record."""
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, output_mode(path.parent))
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
